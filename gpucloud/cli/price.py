"""`gpucloud price`: what an hour of each GPU type costs, versioned by date."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

import typer

from gpucloud.cli.login import client
from gpucloud.cli.output import JsonFlag, console, emit, table
from gpucloud.errors import UserError

app = typer.Typer(
    help="Prices per GPU-hour, per GPU type and pool (operators set them).", no_args_is_help=True
)


def parse_when(text: str) -> float:
    """An ISO date or date-time (UTC unless it says otherwise) -> epoch seconds."""
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise UserError(
            f"--from {text!r}: use a date like 2026-12-01 or 2026-12-01T08:00"
        ) from None
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()


def when(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@app.command("set")
def set_(
    gpu_type: Annotated[str, typer.Argument(help="GPU type from the catalog, e.g. H100-SXM.")],
    per_hour: Annotated[float, typer.Argument(min=0, help="USD per GPU-hour.")],
    pool: Annotated[
        str, typer.Option(help="Only nodes with this label, key=value (default: all).")
    ] = "",
    from_: Annotated[
        str | None,
        typer.Option("--from", help="When it takes effect: now (default) or a later date."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Set the price of GPU_TYPE from now (or --from) on; usage before keeps its price."""
    body = {"gpu_type": gpu_type, "pool": pool, "per_hour": per_hour}
    if from_ is not None:
        body["effective_from"] = parse_when(from_)
    p = client().post("/prices", body)
    emit(
        p,
        as_json,
        lambda p: console.print(
            f"{p['gpu_type']}{' pool ' + p['pool'] if p['pool'] else ''}: "
            f"${p['per_hour']:g} per GPU-hour from {when(p['effective_from'])}",
            highlight=False,
        ),
    )


@app.command("list")
def list_(
    gpu_type: Annotated[str | None, typer.Option(help="Only this GPU type.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Every price version; a GPU type without one costs its catalog price."""
    emit(client().get("/prices", gpu_type=gpu_type), as_json, _render)


def _render(prices: list[dict]) -> None:
    console.print(
        table(
            "Prices (USD per GPU-hour)",
            ["gpu type", "pool", "per hour", "from", "until"],
            [
                (
                    p["gpu_type"],
                    p["pool"] or "all",
                    f"{p['per_hour']:g}",
                    when(p["effective_from"]),
                    when(p["effective_until"]),
                )
                for p in prices
            ],
        )  # fmt: skip
    )
