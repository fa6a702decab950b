"""`gpucloud doctor`: the machine's backend, versions, devices, links, memory and collectives,
each line OK, WARN or FAIL with what to do. Exits 1 when a check fails.

`--job ID` (or `--run-dir DIR`) names what slows down or hurts a training run, from its
metrics and log; `--trace FILE` ranks the ops of a profiler trace by self time."""

from __future__ import annotations

import json
from pathlib import Path
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
    job: Annotated[
        int | None,
        typer.Option("--job", min=1, help="Diagnose this job (its metrics and log, via the API)."),
    ] = None,
    run_dir: Annotated[
        Path | None,
        typer.Option("--run-dir", help="Diagnose the run in this dir (metrics.jsonl; log: *.log)."),
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option(
            "--trace", help="Summarise a profiler trace (`gpucloud train run --profile-steps`)."
        ),
    ] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="Ops to show with --trace.")] = 10,
    as_json: JsonFlag = False,
) -> None:
    """Check that this machine can train and serve: one line per check, with the fix."""
    if sum(x is not None for x in (job, run_dir, trace)) > 1:
        raise UserError("give one of --job, --run-dir and --trace")
    if trace is not None:
        _trace(trace, top, as_json)
        return
    if job is not None or run_dir is not None:
        records, log = _job_files(job) if job is not None else _run_files(run_dir)
        _report(_diagnose(records, log, f"job {job}" if job else str(run_dir)), as_json)
        return
    if allreduce_mib < 0:
        raise UserError(f"--allreduce-mib must be >= 0, got {allreduce_mib}")
    from gpucloud.hal.doctor import run_checks

    _report([c.to_json() for c in run_checks(allreduce_mib << 20 or None)], as_json)


def _report(checks: list[dict[str, Any]], as_json: bool) -> None:
    emit(checks, as_json, _render)
    if any(c["status"] == "FAIL" for c in checks):
        raise typer.Exit(1)


def _job_files(job_id: int) -> tuple[list[dict], str]:
    from gpucloud.cli.login import client

    c = client()
    return _records(c.get(f"/jobs/{job_id}/metrics")), c.get(f"/jobs/{job_id}/logs")


def _run_files(run_dir: Path) -> tuple[list[dict], str]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path} does not exist: give the run dir of `gpucloud train run`")
    log = "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("*.log")))
    return _records(path.read_text()), log


def _records(text: str) -> list[dict]:
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line being written as we read
    return records


def _diagnose(records: list[dict], log: str, what: str) -> list[dict[str, Any]]:
    from gpucloud.train.bottlenecks import diagnose

    try:
        return [c.to_json() for c in diagnose(records, log)]
    except ValueError as e:
        raise UserError(f"{what}: {e}") from None


def _trace(path: Path, top: int, as_json: bool) -> None:
    from dataclasses import asdict

    from gpucloud.train.trace_summary import read_events, top_ops

    ops = [asdict(o) for o in top_ops(read_events(path), top)]
    if not ops:
        raise UserError(
            f"{path} holds no op events: record steps with `gpucloud train run --profile-steps`"
        )
    emit(ops, as_json, lambda rows: _render_ops(path, rows))


def _render_ops(path: Path, ops: list[dict[str, Any]]) -> None:
    rows = [
        [o["name"], o["kind"], str(o["calls"]), f"{o['self_seconds'] * 1e3:.2f}"]
        + [f"{o['share']:.1%}"]
        for o in ops
    ]
    columns = ["op", "kind", "calls", "self ms", "share of kind"]
    console.print(table(f"Top ops by self time: {path.name}", columns, rows), highlight=False)


def _render(checks: list[dict[str, Any]]) -> None:
    rows = [
        (c["name"], f"[{_STYLE[c['status']]}]{c['status']}[/]", c["detail"], c["fix"] or "")
        for c in checks
    ]
    t = table("gpucloud doctor", ["check", "status", "detail", "what to do"], rows)
    for column in t.columns:
        column.justify = "left"
    console.print(t, highlight=False)
