"""`gpucloud hal`: what the hardware abstraction layer picks on this machine."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from gpucloud.cli.output import JsonFlag, console, emit, table

app = typer.Typer(help="Hardware abstraction: the ops each backend runs.", no_args_is_help=True)


@app.command("ops")
def ops_(
    backend: Annotated[
        str | None, typer.Option("--backend", help="Only this backend (cpu, cuda, npu, ...).")
    ] = None,
    op: Annotated[str | None, typer.Option("--op", help="Only this op.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Per op, the implementation each backend uses: its first one this machine can run,
    else the reference; the ones it cannot run here are named with it."""
    from gpucloud.errors import unknown_name
    from gpucloud.hal import device, ops

    if backend is not None and backend not in device.BACKENDS:
        raise unknown_name("backend", backend, device.BACKENDS)
    if op is not None and op not in ops.op_names():
        raise unknown_name("op", op, ops.op_names())
    present = device.available()
    data = {
        "backends": {
            name: {
                "present": name in present,
                "ops": {
                    o: {
                        "uses": ops.choose(o, name).name,
                        "candidates": [
                            {"name": i.name, "available": i.available()}
                            for i in ops.implementations(o, name)
                        ],
                    }
                    for o in ([op] if op else ops.op_names())
                },
            }
            for name in ([backend] if backend else device.BACKENDS)
        }
    }
    emit(data, as_json, _render)


def _render(d: dict[str, Any]) -> None:
    backends = d["backends"]
    columns = ["op"] + [b + ("" if v["present"] else " (absent)") for b, v in backends.items()]
    ops = next(iter(backends.values()))["ops"]
    rows = [[op] + [_cell(v["ops"][op]) for v in backends.values()] for op in ops]
    title = "Op implementations per backend"
    console.print(table(title, columns, rows), highlight=False)


def _cell(choice: dict[str, Any]) -> str:
    missing = [c["name"] for c in choice["candidates"] if not c["available"]]
    return choice["uses"] + (f" (not here: {', '.join(missing)})" if missing else "")
