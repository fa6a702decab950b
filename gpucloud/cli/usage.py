"""`gpucloud usage`: GPU-hours and cost per tenant and workload."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Annotated

import typer

from gpucloud.cli.output import JsonFlag, console, emit, table
from gpucloud.durations import parse_duration
from gpucloud.errors import UserError


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


def usage(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant (operators).")] = None,
    since: Annotated[str | None, typer.Option(help="24h, 7d, or an ISO date.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """GPU-hours and cost (hardware catalog prices) per tenant and per job or deployment."""
    from gpucloud.cli.login import client

    report = client().get("/usage", tenant=tenant, since=parse_since(since) if since else None)
    emit(report, as_json, _render)
