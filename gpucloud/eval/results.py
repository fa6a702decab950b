"""`evaluate`: a task on a backend, as the result a person reads and `compare` reads back.

A result is JSON: {"task", "metric", "score", "ci_low", "ci_high", "n"} for the chosen
metric, then "task_hash" (the file measured), "model", "seed", every metric of the task under
"metrics", and the per-item records under "items" (what a paired comparison resamples). A
perplexity result also has its rolling windows' "max_length" and "stride" (windows.py):
scores with other windows differ, and `compare` tells them apart.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpucloud.errors import UserError
from gpucloud.eval.backend import Backend
from gpucloud.eval.metrics import bootstrap_ci, metric_for, metrics_of
from gpucloud.eval.scoring import score_task
from gpucloud.eval.tasks import Task, TaskKind
from gpucloud.eval.windows import resolve_stride


def evaluate(
    task: Task,
    backend: Backend,
    metric: str | None = None,
    seed: int = 0,
    stride: int | None = None,
) -> dict:
    """Score every item of `task` on `backend` (perplexity texts in windows `stride` tokens
    apart); the result dict described above."""
    chosen = metric_for(task.kind, metric)
    records = score_task(task, backend, stride)
    scores = {}
    for m in metrics_of(task.kind):
        low, high = bootstrap_ci(m, records, seed)
        scores[m.name] = {"score": float(m.value(records)), "ci_low": low, "ci_high": high}
    windows = {}
    if task.kind is TaskKind.PERPLEXITY:
        length = backend.max_length
        windows = {"max_length": length, "stride": resolve_stride(length, stride)}
    return {
        "task": task.name,
        "metric": chosen.name,
        **scores[chosen.name],
        "n": len(records),
        "task_hash": task.hash,
        "kind": str(task.kind),
        "model": backend.name,
        "seed": seed,
        **windows,
        "metrics": scores,
        "items": records,
    }


def load_result(path: str | Path) -> dict:
    """A result written by `gpucloud eval --json`. Raises UserError when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        message = f"{path} is not JSON ({e.msg}): give the output of `gpucloud eval ... --json`"
        raise UserError(message) from None
    keys = {"task", "metric", "task_hash", "kind", "items"}
    if not isinstance(data, dict) or not keys <= data.keys():
        raise UserError(
            f"{path} is not a result of `gpucloud eval ... --json` (needs {sorted(keys)})"
        )
    if data["kind"] not in set(TaskKind):
        raise UserError(f"{path}: unknown task kind {data['kind']!r}")
    return data
