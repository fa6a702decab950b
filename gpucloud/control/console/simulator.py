"""The console's simulator page: replay an uploaded trace (or an example) under several
policies with the scheduler's own simulator, and send back what the page plots.

The simulator is imported when first used: the control plane loads numpy's half of the
scheduler only for someone who simulates.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from gpucloud.errors import UserError

MAX_TRACE_BYTES = 4 * 1024 * 1024
MAX_JOBS = 2000  # an uploaded trace's first jobs: a replay stays within seconds
POINTS = 120  # per plotted curve
# Example traces made on the spot (synthetic, seeded): name -> (load, label).
EXAMPLES = {
    "busy": (0.9, "300 synthetic jobs, 90% offered load, 8 x 8 GPUs"),
    "overloaded": (1.3, "300 synthetic jobs, 130% offered load, 8 x 8 GPUs"),
}
EXAMPLE_CLUSTER = "8x8"
DEFAULT_POLICIES = ("fifo", "gpucloud")


def policy_names() -> list[str]:
    from gpucloud.scheduler import POLICIES

    return list(POLICIES)


def run(trace_csv: bytes, example: str, cluster: str, policies: list[str]) -> dict:
    """Replay the uploaded CSV (or, if empty, the example named) on `cluster` (NODESxGPUS,
    as `gpucloud sim --cluster`; empty = sized for 90% load) under each policy. Returns
    the summary table's HTML rows, and the JCT CDF and utilisation curves, each as uPlot
    data (x values, then one row per policy). Raises UserError for bad input."""
    from gpucloud.scheduler import get_policy, parse_cluster, simulate

    if not policies:
        raise UserError("choose at least one policy to compare")
    chosen = [get_policy(p) for p in policies]
    trace, default_cluster = _trace(trace_csv, example)
    nodes = parse_cluster(cluster.strip() or default_cluster)
    results = [simulate(trace, nodes, p) for p in chosen]
    return {
        "policies": [{"policy": r.policy, **_figures(r.summary)} for r in results],
        "table": _table(results),
        "cdf": _cdf(results),
        "utilisation": _utilisation(results),
    }


def _trace(csv: bytes, example: str):
    from gpucloud.scheduler import load_trace
    from gpucloud.scheduler.sim.sweep import auto_cluster
    from gpucloud.scheduler.sim.synthetic import synthetic_trace

    if not csv:
        if example not in EXAMPLES:
            raise UserError(f"no example {example!r}: choose one of {', '.join(EXAMPLES)}")
        return synthetic_trace(300, 64, load=EXAMPLES[example][0], seed=0), EXAMPLE_CLUSTER
    if len(csv) > MAX_TRACE_BYTES:
        raise UserError(f"trace too large: at most {MAX_TRACE_BYTES} bytes here (use gpucloud sim)")
    with tempfile.NamedTemporaryFile(suffix=".csv") as f:
        f.write(csv)
        f.flush()
        trace = load_trace(Path(f.name), limit=MAX_JOBS)
    if not trace.jobs:
        raise UserError("the uploaded trace has no jobs to replay")
    return trace, auto_cluster(trace, 0.9)


def _figures(summary: dict) -> dict:
    keys = ("jobs", "avg_jct_s", "p95_jct_s", "avg_queue_s", "utilization", "preemptions")
    return {k: summary[k] for k in keys}


def _table(results) -> str:
    from html import escape

    from gpucloud.scheduler.sim.report import headers, rows

    head = "".join(f'<th scope="col">{escape(h)}</th>' for h in headers(results))
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows(results)
    )
    return f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody>"


def _cdf(results) -> list[list[float]]:
    """x: JCT in hours on one grid for all policies; each row: the share of jobs done by x."""
    import numpy as np

    jcts = [np.sort([r.jct / 3600 for r in res.records]) for res in results]
    top = max((float(j[-1]) for j in jcts if len(j)), default=1.0)
    grid = np.linspace(0.0, top, POINTS)
    shares = [np.searchsorted(j, grid, side="right") / max(len(j), 1) for j in jcts]
    return [grid.tolist(), *(s.tolist() for s in shares)]


def _utilisation(results) -> list[list[float]]:
    """x: hours since the first event; each row: the share of GPUs busy then."""
    import numpy as np

    spans = [(res.sampler.times, res.sampler.busy, res.capacity) for res in results]
    start = min((t[0] for t, _, _ in spans if t), default=0.0)
    end = max((t[-1] for t, _, _ in spans if t), default=start + 1.0)
    grid = np.linspace(start, end, POINTS)
    rows = []
    for times, busy, capacity in spans:
        at = np.searchsorted(np.asarray(times), grid, side="right") - 1
        used = np.where(at >= 0, np.asarray(busy or [0.0])[np.clip(at, 0, None)], 0.0)
        rows.append((used / max(capacity, 1)).tolist())
    return [((grid - start) / 3600).tolist(), *rows]
