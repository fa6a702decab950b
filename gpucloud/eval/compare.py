"""The regression gate: is B worse than A on the same task, beyond the task's noise?

Both results score the same items, so the items are resampled in pairs: the interval of
B - A then holds only the noise of which items the task happens to have, not the spread of
each model's scores around its own mean. B is worse when that whole interval lies on the
worse side of zero.
"""

from __future__ import annotations

from gpucloud.errors import UserError
from gpucloud.eval.metrics import interval, metric_for, resample
from gpucloud.eval.tasks import TaskKind


def compare(a: dict, b: dict, metric: str | None = None, seed: int = 0) -> dict:
    """{"task", "metric", "a", "b", "difference" (b - a), "ci_low", "ci_high", "n",
    "higher_is_better", "worse"}. Raises UserError when the two results are of different
    task files, or perplexities of windows with different strides (a result from before
    strides were recorded has none, and compares with any)."""
    if a["task_hash"] != b["task_hash"]:
        raise UserError(
            f"A measured {a['task']} ({a['task_hash'][:19]}) and B {b['task']} "
            f"({b['task_hash'][:19]}): compare results of the same task file"
        )
    if a.get("stride") != b.get("stride") and None not in (a.get("stride"), b.get("stride")):
        raise UserError(
            f"A was scored in windows {a['stride']} tokens apart and B {b['stride']}: compare "
            "results of one --stride"
        )
    if len(a["items"]) != len(b["items"]):
        raise UserError(f"A has {len(a['items'])} items and B {len(b['items'])}: not comparable")
    m = metric_for(TaskKind(a["kind"]), metric or a["metric"])
    idx = resample(len(a["items"]), seed)
    low, high = interval(m.value(b["items"], idx) - m.value(a["items"], idx))
    score_a, score_b = float(m.value(a["items"])), float(m.value(b["items"]))
    worse = high < 0 if m.higher_is_better else low > 0
    return {
        "task": a["task"],
        "metric": m.name,
        "a": score_a,
        "b": score_b,
        "difference": score_b - score_a,
        "ci_low": low,
        "ci_high": high,
        "n": len(a["items"]),
        "higher_is_better": m.higher_is_better,
        "worse": bool(worse),
    }
