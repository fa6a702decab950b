"""`gpucloud node`: the machines and their accelerators."""

from __future__ import annotations

from typing import Annotated

import typer

from gpucloud.cli.login import client
from gpucloud.cli.output import JsonFlag, console, emit, table

app = typer.Typer(help="Nodes: machines and their accelerators.", no_args_is_help=True)
NodeName = Annotated[str, typer.Argument(help="Node name (see gpucloud node list).")]


def _render(rows: list[dict]) -> None:
    console.print(
        table(
            "Nodes",
            [
                "name",
                "gpu type",
                "gpus",
                "allocated",
                "cpus",
                "memory GiB",
                "link domain",
                "backend",
                "state",
            ],  # fmt: skip
            [
                (
                    n["name"],
                    n["gpu_type"],
                    n["gpus"],
                    n["gpus_allocated"],
                    _used(n["cpus_allocated"], n["cpus"]),
                    _used(n["memory_gib_allocated"], n["memory_gib"]),
                    n["link_domain"],
                    n["backend"],
                    n["state"] + (f" ({n['reason']})" if n.get("reason") else ""),
                )
                for n in rows
            ],
        )
    )


def _used(allocated: float, total: float) -> str:
    return f"{allocated:g} / {total:g}" if total else "-"


@app.command("list")
def list_(as_json: JsonFlag = False) -> None:
    """Nodes with their GPUs, CPUs and memory, how much is allocated, and their state."""
    emit(client().get("/nodes"), as_json, _render)


@app.command("cordon")
def cordon(name: NodeName, as_json: JsonFlag = False) -> None:
    """Take no new work on NAME (what runs there keeps running)."""
    emit(client().post(f"/nodes/{name}/cordon"), as_json, lambda n: _render([n]))


@app.command("drain")
def drain(name: NodeName, as_json: JsonFlag = False) -> None:
    """Take NAME out gracefully: no new work, its replicas move elsewhere, its jobs finish."""
    emit(client().post(f"/nodes/{name}/drain"), as_json, lambda n: _render([n]))


@app.command("uncordon")
def uncordon(name: NodeName, as_json: JsonFlag = False) -> None:
    """Let NAME take new work again."""
    emit(client().post(f"/nodes/{name}/uncordon"), as_json, lambda n: _render([n]))
