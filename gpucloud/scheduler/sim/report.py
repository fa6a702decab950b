"""A comparison report: one Markdown table and three PNG plots (JCT CDF, queue length
and GPU utilization over time) for replays of the same trace under several policies."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gpucloud.scheduler.sim.simulator import Result

HOUR = 3600.0
COLUMNS = (
    ("policy", "policy", None),
    ("avg JCT (h)", "avg_jct_s", HOUR),
    ("p95 JCT (h)", "p95_jct_s", HOUR),
    ("avg wait (h)", "avg_queue_s", HOUR),
    ("p95 wait (h)", "p95_queue_s", HOUR),
    ("max wait (h)", "max_wait_s", HOUR),
    ("makespan (h)", "makespan_s", HOUR),
    ("util", "utilization", 1.0),
    ("frag", "fragmentation", 1.0),
    ("preempt", "preemptions", None),
    ("Jain", "jain_fairness", 1.0),
)


def rows(results: list[Result]) -> list[list[str]]:
    """Table rows, figures rounded for people; ratios to the first result in the last column."""
    base = results[0].summary["avg_jct_s"] or 1.0
    out = []
    for r in results:
        s = r.summary
        cells = [
            str(s[key]) if scale is None else f"{s[key] / scale:.2f}" for _, key, scale in COLUMNS
        ]
        out.append([*cells, f"{s['avg_jct_s'] / base:.2f}"])
    return out


def headers(results: list[Result]) -> list[str]:
    return [c for c, _, _ in COLUMNS] + [f"JCT / {results[0].policy}"]


def markdown(results: list[Result]) -> str:
    first = results[0]
    lines = [
        f"# {first.trace} on {first.cluster} ({first.summary['jobs']} jobs, "
        f"{first.summary['skipped']} skipped)",
        "",
        "| " + " | ".join(headers(results)) + " |",
        "|" + "---|" * len(headers(results)),
        *("| " + " | ".join(r) + " |" for r in rows(results)),
        "",
        "![JCT CDF](jct_cdf.png)",
        "![queue length](queue.png)",
        "![utilization](utilization.png)",
        "",
    ]
    return "\n".join(lines)


def write_report(results: list[Result], out: Path) -> list[Path]:
    """Write report.md and the plots into `out`; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.md", out / "jct_cdf.png", out / "queue.png", out / "utilization.png"]
    paths[0].write_text(markdown(results))

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        jct = np.sort([x.jct / HOUR for x in r.records])
        ax.plot(jct, np.arange(1, len(jct) + 1) / max(len(jct), 1), label=r.policy)
    ax.set(xscale="symlog", xlabel="job completion time (h)", ylabel="fraction of jobs")
    _save(fig, ax, paths[1])

    for path, series, label in (
        (paths[2], lambda r: r.sampler.queue, "jobs waiting"),
        (paths[3], lambda r: np.asarray(r.sampler.busy) / r.capacity, "GPUs allocated (share)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in results:
            t = (np.asarray(r.sampler.times) - r.sampler.times[0]) / HOUR
            ax.step(t, series(r), where="post", label=r.policy, linewidth=0.8)
        ax.set(xlabel="time (h)", ylabel=label)
        _save(fig, ax, path)
    return paths


def _save(fig, ax, path: Path) -> None:
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
