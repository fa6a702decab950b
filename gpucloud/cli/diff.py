"""`gpucloud diff`: where two configurations of a model (backend, dtype, checkpoint, ops) part."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer

from gpucloud.cli.output import JsonFlag, console, emit, table
from gpucloud.errors import UserError

REFERENCE_OPS = "reference"  # gpucloud.hal.ops.REFERENCE, named here so the CLI loads no torch


def diff(
    model_dir: Annotated[Path, typer.Argument(help="An HF model directory (run A).")],
    a: Annotated[str, typer.Option("--a", help="Run A as BACKEND:DTYPE.")] = "cpu:float32",
    b: Annotated[
        str | None,
        typer.Option(
            "--b", help="Run B as BACKEND:DTYPE [default: cpu:bfloat16; with --b-ops: --a]."
        ),
    ] = None,
    b_model: Annotated[
        Path | None,
        typer.Option("--b-model", help="Run B on this checkpoint of the same architecture."),
    ] = None,
    b_ops: Annotated[
        str | None,
        typer.Option(
            "--b-ops", help="Run B on these ops for every op: reference (see `gpucloud hal ops`)."
        ),
    ] = None,
    prompt: Annotated[
        str | None, typer.Option("--prompt", help="Text to run (default: seeded random tokens).")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random tokens.")] = 0,
    tolerance: Annotated[
        float | None,
        typer.Option(
            "--tolerance",
            help="Relative error past which a module diverges "
            "[default: by dtype: 1e-3 float32, 1e-2 float16, 5e-2 bfloat16].",
        ),
    ] = None,  # fmt: skip
    as_json: JsonFlag = False,
) -> None:
    """Run the same tokens through two configurations and compare every module's output."""
    for path in (model_dir, b_model):
        if path is not None and not (path / "config.json").is_file():
            raise UserError(f"{path} is not a model directory (no config.json)")
    if b_ops is not None and b_ops != REFERENCE_OPS:
        raise UserError(
            f"--b-ops must be {REFERENCE_OPS!r} (the registry's reference ops), got {b_ops!r}"
        )
    if tolerance is not None and not tolerance >= 0:
        raise UserError(f"--tolerance must be >= 0, got {tolerance}")
    from gpucloud.models.diff import RunConfig, numeric_diff, prompt_tokens, sample_tokens
    from gpucloud.models.spec import ModelSpec

    run_a = RunConfig.parse(a)
    run_b = RunConfig.parse(b or (a if b_ops else "cpu:bfloat16"))
    if b_ops:
        run_b = dataclasses.replace(run_b, ops=b_ops)
    if prompt is None:
        tokens = sample_tokens(ModelSpec.from_dir(model_dir), seed)
    else:
        tokens = prompt_tokens(model_dir, prompt)
    report = numeric_diff(model_dir, b_model or model_dir, run_a, run_b, tokens, tolerance)
    emit(report.to_json(), as_json, _render)


def _render(d: dict[str, Any]) -> None:
    first = d["first_divergent"]
    rows = [
        (
            ("> " if m["name"] == first else "") + m["name"],
            _num(m["max_abs"]),
            _num(m["rel"]),
            m.get("note", ""),
        )
        for m in d["modules"]
    ]
    title = f"{d['a']} vs {d['b']}, relative tolerance {d['tolerance']:g}"
    console.print(table(title, ["module", "max abs", "rel", "note"], rows), highlight=False)
    if first:
        console.print(f"first module past the tolerance: {first}", highlight=False)
    else:
        console.print("every module within the tolerance", highlight=False)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"
