"""How far the policies are from what any scheduler could do: a clairvoyant lower bound on
the average JCT, with and without issue 3's limit on the longest wait.

The bound is the time-indexed LP of `gpucloud.scheduler.sim.bound` (a relaxation of every
real schedule: durations known, preemption free, no placement), with W = the wait limit.

Baselines from the same run: strict FIFO (the unit), plain SJF by estimate and the
`gpucloud` preset. W = FIFO's longest wait on that trace, as in the issue's target.

Between the bound and the online presets sits a threshold policy with hindsight: shortest
GPU-time first (EASY backfill, quotas with borrowing and reclaim, as the preset), and a job
starves after f x W, where W is FIFO's longest wait on this very trace and f is tuned on it
(the largest f on a grid that keeps every wait within W). It is run twice: knowing the true
durations, and with the users' estimates the presets get. It shows what knowing the future
buys: W is only known once the trace is over, and the best f differs from trace to trace.

Run: .venv/bin/python benchmarks/scheduler_bound.py [--slot-hours 4]
"""

from __future__ import annotations

import math
import sys
import time

from gpucloud.scheduler import (
    POLICIES,
    EstimateModel,
    Policy,
    load_trace,
    parse_cluster,
    simulate,
)
from gpucloud.scheduler.policies.sjf import Sjf
from gpucloud.scheduler.sim.bound import jct_lower_bound

TRACES = "/work/shared/traces"
H = 3600.0


def hindsight_threshold(trace, nodes, fifo: dict, oracle: bool) -> tuple[float, dict] | None:
    """(f, summary) of the SJF-by-GPU-time policy whose starvation threshold f x W gives the
    lowest average JCT with max wait <= W (FIFO's): f on a 0.05 grid from 0.40 to 0.95, then
    in 0.01 steps above the best one. None if no f keeps waits within W."""
    w = fifo["max_wait_s"]
    sjf = Sjf(by_gpu_time=True, oracle=oracle, default_estimate=math.inf)
    estimates = EstimateModel(sigma=0.0, missing=0.0) if oracle else EstimateModel()
    best: tuple[float, dict] | None = None

    def scan(fs) -> None:
        nonlocal best
        for f in fs:
            policy = Policy(
                f"sjf-gpu-time, starve after {f:.2f} W", sjf, backfill="easy", quotas=True,
                reclaim=True, starvation_after=f * w,
            )  # fmt: skip
            s = simulate(trace, nodes, policy, estimates=estimates).summary
            if s["max_wait_s"] <= w and (best is None or s["avg_jct_s"] < best[1]["avg_jct_s"]):
                best = (f, s)

    scan(round(0.40 + 0.05 * i, 2) for i in range(12))
    if best is not None:
        scan(round(best[0] + 0.01 * i, 2) for i in range(1, 5))
    return best


def bound(title: str, path: str, cluster: str, slot: float, vc: str | None = None) -> None:
    trace = load_trace(path, vc=vc)
    nodes = parse_cluster(cluster)
    gpus = sum(n.num_gpus for n in nodes)
    runs = {p: simulate(trace, nodes, POLICIES[p]) for p in ("fifo", "sjf", "gpucloud")}
    fifo = runs["fifo"].summary
    jobs = [(r.submit, r.duration, r.gpus) for r in runs["fifo"].records]
    print(f"\n## {title}: {len(jobs)} jobs on {cluster} GPUs, {slot / H:g} h slots\n")
    print("| schedule | avg JCT (h) | JCT / FIFO | max wait / FIFO |")
    print("|---|---|---|---|")
    for name, run in runs.items():
        s = run.summary
        print(f"| {name} | {s['avg_jct_s'] / H:.1f} | {s['avg_jct_s'] / fifo['avg_jct_s']:.3f} | "
              f"{s['max_wait_s'] / fifo['max_wait_s']:.3f} |")  # fmt: skip
    for oracle, knows in ((True, "true durations"), (False, "user estimates")):
        found = hindsight_threshold(trace, nodes, fifo, oracle)
        if found is None:
            print(f"| hindsight threshold, {knows}: no f keeps waits <= W | - | - | - |")
            continue
        f, s = found
        print(f"| hindsight threshold f = {f:.2f}, {knows} | {s['avg_jct_s'] / H:.1f} | "
              f"{s['avg_jct_s'] / fifo['avg_jct_s']:.3f} | "
              f"{s['max_wait_s'] / fifo['max_wait_s']:.3f} |")  # fmt: skip
    for label, limit in (("no wait limit", None), ("waits <= FIFO's max", fifo["max_wait_s"])):
        t0 = time.perf_counter()
        lb = jct_lower_bound(jobs, gpus, slot, limit)
        took = time.perf_counter() - t0
        print(f"| LP bound, {label} (solved in {took:.0f} s) | {lb / H:.1f} | "
              f"{lb / fifo['avg_jct_s']:.3f} | {'<= 1' if limit else '-'} |")  # fmt: skip


def main() -> None:
    slot = 4 * H
    if "--slot-hours" in sys.argv:
        slot = float(sys.argv[sys.argv.index("--slot-hours") + 1]) * H
    bound("Microsoft ITP cluster03", f"{TRACES}/microsoft_itp_2021/raw/cluster03.csv", "20x8",
          slot)  # fmt: skip
    bound("Philly VC ee9e8c", f"{TRACES}/microsoft_philly_2017/philly_jobs_pollux.csv", "16x8",
          slot, vc="ee9e8c")  # fmt: skip


if __name__ == "__main__":
    main()
