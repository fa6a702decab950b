"""`gpucloud doctor`: the machine's backend, versions, devices, links, memory and collectives,
each line OK, WARN or FAIL with what to do. Exits 1 when a check fails."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from gpucloud.cli.output import JsonFlag, console, emit, table
from gpucloud.errors import UserError

_STYLE = {"OK": "green", "WARN": "yellow", "FAIL": "red"}


def doctor(
    allreduce_mib: Annotated[
        int,
        typer.Option("--allreduce-mib", help="Size of the all-reduce test; 0 skips it."),
    ] = 16,
    as_json: JsonFlag = False,
) -> None:
    """Check that this machine can train and serve: one line per check, with the fix."""
    if allreduce_mib < 0:
        raise UserError(f"--allreduce-mib must be >= 0, got {allreduce_mib}")
    from gpucloud.hal.doctor import run_checks

    checks = [c.to_json() for c in run_checks(allreduce_mib << 20 or None)]
    emit(checks, as_json, _render)
    if any(c["status"] == "FAIL" for c in checks):
        raise typer.Exit(1)


def _render(checks: list[dict[str, Any]]) -> None:
    rows = [
        (c["name"], f"[{_STYLE[c['status']]}]{c['status']}[/]", c["detail"], c["fix"] or "")
        for c in checks
    ]
    t = table("gpucloud doctor", ["check", "status", "detail", "what to do"], rows)
    for column in t.columns:
        column.justify = "left"
    console.print(t, highlight=False)
