"""`gpucloud usage`: GPU-hours and cost per tenant and workload."""

from __future__ import annotations

import csv
import sys
import time
from datetime import datetime
from enum import StrEnum
from typing import Annotated

import typer

from gpucloud.cli.output import JsonFlag, console, emit, table
from gpucloud.durations import parse_duration
from gpucloud.errors import UserError


class Format(StrEnum):
    TABLE = "table"
    CSV = "csv"
    JSON = "json"


def parse_since(text: str) -> float:
    """'90m', '24h', '7d' ago, or an ISO date/time; returns epoch seconds."""
    ago = parse_duration(text)
    if ago is not None:
        return time.time() - ago
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise UserError(
            f"--since {text!r}: use a duration like 90m, 24h, 7d or a date like 2025-11-01"
        ) from None


def _render(r: dict) -> None:
    console.print(
        table(
            "Usage by workload",
            ["tenant", "kind", "id", "name", "gpu type", "GPU-hours", "cost $"],
            [
                (
                    x["tenant"],
                    x["kind"],
                    x["id"],
                    x["name"],
                    x["gpu_type"],
                    f"{x['gpu_hours']:.4f}",
                    f"{x['cost']:.4f}",
                )
                for x in r["lines"]
            ],
        )
    )
    console.print(
        table(
            "Usage by tenant",
            ["tenant", "GPU-hours", "cost $"],
            [(t, f"{v['gpu_hours']:.4f}", f"{v['cost']:.4f}") for t, v in r["tenants"].items()],
        )
    )


def _render_showback(r: dict) -> None:
    console.print(
        table(
            "Usage by " + ", ".join(r["by"]),
            [*r["by"], "GPU-hours", "requested", "waste", "cost $"],
            [
                (
                    *x["group"].values(),
                    f"{x['gpu_hours']:.4f}",
                    f"{x['requested_gpu_hours']:.4f}",
                    f"{x['waste_gpu_hours']:.4f}",
                    f"{x['cost']:.4f}",
                )
                for x in r["rows"]
            ],
        )  # fmt: skip
    )


def _csv(r: dict) -> None:
    out = csv.writer(sys.stdout, lineterminator="\n")
    out.writerow([*r["by"], "gpu_hours", "requested_gpu_hours", "waste_gpu_hours", "cost_usd"])
    for x in r["rows"]:
        numbers = (x["gpu_hours"], x["requested_gpu_hours"], x["waste_gpu_hours"], x["cost"])
        out.writerow([*x["group"].values(), *(f"{n:.6f}" for n in numbers)])


def usage(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant (operators).")] = None,
    since: Annotated[str | None, typer.Option(help="24h, 7d, or an ISO date.")] = None,
    by: Annotated[
        str | None,
        typer.Option(help="Group by a list of: tenant, user, label, label:KEY, gpu_type, node."),
    ] = None,
    format_: Annotated[
        Format | None, typer.Option("--format", help="table, csv or json (default: table).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """GPU-hours and cost per tenant and per job or deployment, at the prices in effect
    over each interval (`gpucloud price`); with --by, grouped, with requested GPU-hours
    (GPUs x time limit of each finished run) and the waste beside them."""
    from gpucloud.cli.login import client

    fmt = Format.JSON if as_json else format_ or Format.TABLE
    start = parse_since(since) if since else None
    if by is None and fmt != Format.CSV:
        report = client().get("/usage", tenant=tenant, since=start)
        emit(report, fmt == Format.JSON, _render)
        return
    report = client().get("/usage/showback", by=by or "tenant", tenant=tenant, since=start)
    if fmt == Format.CSV:
        _csv(report)
    else:
        emit(report, fmt == Format.JSON, _render_showback)
