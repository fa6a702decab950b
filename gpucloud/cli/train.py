"""`gpucloud train RUN.toml` (launch torchrun) and `gpucloud train export CKPT --out DIR`.

`gpucloud train FILE` is short for `gpucloud train run FILE`. torch is imported only by the
workers and by `export`; the launcher checks the config without it. While the workers run,
each step rank 0 logs shows on stderr: a live bar on a terminal, one plain line per logged
step otherwise (job logs, pipes), so stdout keeps only the plan, the outcome and `--json`.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Annotated

import typer

from gpucloud.cli.groups import RunByDefault
from gpucloud.cli.output import JsonFlag, console, emit, err_console, print_json, table
from gpucloud.errors import UserError

app = typer.Typer(
    cls=RunByDefault,
    help="Train with torchrun (DDP, FSDP2, pipeline); export checkpoints.",
    no_args_is_help=True,
)


@app.command("run")
def run(
    config: Annotated[Path, typer.Argument(help="Run config (TOML).")],
    run_dir: Annotated[
        str | None,
        typer.Option("--run-dir", help="Local dir for metrics, checkpoints, status [runs/NAME]."),
    ] = None,
    overrides: Annotated[
        list[str] | None, typer.Option("--set", help="Override a key: section.key=value.")
    ] = None,
    nproc_per_node: Annotated[int, typer.Option("--nproc-per-node", min=1)] = 1,
    nnodes: Annotated[int, typer.Option("--nnodes", min=1)] = 1,
    rdzv: Annotated[
        str | None, typer.Option("--rdzv", help="Rendezvous HOST:PORT (multi-node).")
    ] = None,
    rdzv_id: Annotated[str, typer.Option("--rdzv-id")] = "gpucloud",
    local_addr: Annotated[
        str | None,
        typer.Option(
            "--local-addr",
            help="This node's address as the other nodes reach it (multi-node; default: "
            "its host name).",
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Check and print the plan; start nothing.")
    ] = False,
    profile_steps: Annotated[
        str | None,
        typer.Option(
            "--profile-steps",
            help="A:B: record steps A..B with the torch profiler into "
            "RUN_DIR/profile-steps-A-B.json (Perfetto; `gpucloud doctor --trace`).",
        ),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Check the config, then run torchrun, showing each logged step (loss, tokens/s, ETA) on
    stderr. Exit codes: 0 completed, 1 failed, 2 bad input, 3 stopped by the health policy,
    4 hung (a step outlived health.hang_timeout_s; run again to resume), 143 terminated
    (checkpoint saved; run again to resume)."""
    from gpucloud.train import config as run_config
    from gpucloud.train import launcher

    if profile_steps is not None:  # validated with the config: logging.profile_steps
        overrides = [*(overrides or []), f"logging.profile_steps={json.dumps(profile_steps)}"]
    cfg = launcher.fetch_inputs(run_config.load(config, overrides or []))
    lay = launcher.preflight(cfg, nproc_per_node, nnodes)
    run_dir = _local_run_dir(run_dir, config)
    cmd = launcher.torchrun_command(cfg, run_dir, nproc_per_node, nnodes, rdzv, rdzv_id, local_addr)
    plan = {
        "run_dir": str(run_dir),
        "layout": lay.model_dump() | {"sequences_per_step": lay.sequences_per_step},
        "tokens_per_step": cfg.global_batch * cfg.data.seq_len,
        "command": cmd,
    }
    if dry_run:
        emit(plan, as_json, _print_plan)
        return
    if not as_json:
        _print_plan(plan)
    launcher.prepare_run_dir(cfg, run_dir)
    with console_progress(cfg.optim.max_steps) as on_record:
        code = launcher.run(cmd, run_dir, on_record)
    status = launcher.read_status(run_dir) or {}
    if as_json:
        print_json({**plan, "status": status, "exit_code": int(code)})
    else:
        console.print(f"{code.name.lower()}: step {status.get('step', '?')} (exit {int(code)})")
    sys.exit(int(code))


def _local_run_dir(run_dir: str | None, config: Path) -> Path:
    """--run-dir as a path (default runs/CONFIG_NAME). It holds files the launcher follows
    while the run goes on, so it is local; checkpoints go to shared storage instead."""
    from gpucloud.storage import is_url

    if run_dir is not None and is_url(run_dir):
        raise UserError(
            f"--run-dir {run_dir}: the run dir must be a local path; put checkpoints on "
            f"shared storage with checkpoint.dir = {run_dir.rstrip('/') + '/ckpt'!r}"
        )
    return Path(run_dir) if run_dir else Path("runs") / config.stem


def _print_plan(plan: dict) -> None:
    lay = plan["layout"]
    columns = ["world", "data parallel", "pipeline stages", "micro-batch", "accumulation",
               "tokens/step"]  # fmt: skip
    row = [lay["world_size"], lay["dp"], lay["pp"], lay["micro_batch"], lay["accum"],
           plan["tokens_per_step"]]  # fmt: skip
    if lay["tp"] > 1:  # shown when used, so the usual table stays as narrow as it was
        columns.insert(2, "tensor parallel")
        row.insert(2, lay["tp"])
    console.print(table("Training layout", columns, [tuple(row)]))
    console.print(f"run dir: {plan['run_dir']}", highlight=False)


@contextlib.contextmanager
def console_progress(total: int) -> Iterator[Callable[[dict], None]]:
    """A callback for metrics records: a live bar on a terminal, else plain lines."""
    if not err_console.is_terminal:

        def print_line(record: dict) -> None:
            text = _step_line(record, total) if "loss" in record else _event_line(record, total)
            if text:
                print(text, file=sys.stderr, flush=True)

        yield print_line
        return
    from rich.progress import BarColumn, Progress, TextColumn

    columns = (TextColumn("step {task.completed}/{task.total}"), BarColumn(),
               TextColumn("{task.fields[stats]}"))  # fmt: skip
    with Progress(*columns, console=err_console) as bar:
        task = bar.add_task("train", total=total, stats="")

        def update(record: dict) -> None:
            if "loss" in record:
                bar.update(task, completed=record["step"], stats=_step_stats(record))
            if text := _event_line(record, total):
                bar.console.print(text, highlight=False)

        yield update


def _step_line(record: dict, total: int) -> str:
    return f"step {record['step']}/{total}  {_step_stats(record)}"


def _step_stats(record: dict) -> str:
    loss = "-" if record["loss"] is None else f"{record['loss']:.4f}"
    eta = timedelta(seconds=round(record["eta_s"]))
    stats = f"loss {loss}  tokens/s {record['tokens_per_s']:,.0f}  eta {eta}"
    if "reason" in record:  # a step the health policy acted on
        stats += f"  {record['event']} ({record['reason']})"
    return stats


def _event_line(record: dict, total: int) -> str | None:
    """The line that stays for an event (a resume, a rollback, a step the health policy
    acted on, a validation loss); None for a plain step and for how the run ended (the last
    line says it)."""
    from gpucloud.train.launcher import OUTCOME_CODES

    event = record.get("event")
    if "val_loss" in record:
        return f"step {record['step']}/{total}  val_loss {record['val_loss']:.4f}"
    if event is None or event in OUTCOME_CODES:
        return None
    if "loss" in record:
        return _step_line(record, total)
    details = ", ".join(f"{k} {v}" for k, v in record.items() if k not in ("step", "event"))
    return f"step {record['step']}: {event}" + (f" ({details})" if details else "")


@app.command("export")
def export(
    checkpoint: Annotated[
        str, typer.Argument(help="A step-N dir, checkpoints dir or run dir; a path or a URL.")
    ],
    out: Annotated[Path, typer.Option("--out", help="HF-format model directory to write.")],
    dtype: Annotated[str, typer.Option("--dtype", help="float32 | bfloat16 | float16")] = "float32",
    force: Annotated[bool, typer.Option("--force", help="Write into a non-empty dir.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Consolidate a sharded checkpoint into safetensors that serve and transformers load."""
    from gpucloud.storage import location
    from gpucloud.train.export import export as do_export

    summary = do_export(location(checkpoint), out, dtype=dtype, force=force)
    emit(
        summary,
        as_json,
        lambda s: console.print(
            f"exported step {s['step']} ({s['params']:,} params, {s['dtype']}) "
            f"from {s['checkpoint']} to {s['out']}",
            highlight=False,
        ),
    )
