"""Which starvation guard keeps waits within FIFO's on traces it was not tuned on (issue 18).

Each guard variant is replayed on every ITP cluster, Philly VC ee9e8c and five seeded
synthetic traces (diurnal arrivals, Pareto durations, gangs up to 32 nodes; `gpucloud sim
sweep`'s), with the simulator's estimates (log-normal error sigma 1, 10% missing). Strict
FIFO on the same replay is the unit. The traces are split in two: the four the guards were
looked at while designing them (ITP cluster01 and cluster03, Philly ee9e8c, synthetic s0)
and the others, held out. A variant "holds" on a trace when its max wait is <= 1.05 x
FIFO's and its p99 wait <= 1.01 x FIFO's.

Variants: the `gpucloud` preset (issue 18's fourth round: shortest GPU-time first under
`fsp`'s due guard), the same with jobs without an estimate ordered last, the preset before
("backlog": GPU-time tiers, backlog starvation limit; starving jobs preempt), the same
with starving jobs that never preempt (`guard="reserve"`: an EASY reservation; "block":
nothing starts behind them), the `fsp` preset (due-time guard over a virtual FIFO, slack 0),
the `fsp` preset whose blocked due jobs hold an EASY reservation that later jobs backfill
around (`guard="backfill"`) instead of stopping everything behind them, the same two
with due times moved earlier by the time the due queue needs to drain (`due_lead`: EDF
with lead time), and the due guard with backlog's tier order, looser (`due_share` 0.5
and 1.0: a job is due only once it has also waited that share of the virtual FIFO's
longest wait). Issue 18's second round: backlog with its limit is capped by the
virtual FIFO's longest wait so far (`starvation_fifo`; starving jobs still reserve and
preempt, never block), or with that cap alone; backlog plus the due guard at that
longest wait (`due_slack` 0, `due_share` 1.0: blocking), led, or with due jobs that reserve
and let others backfill (with `min_run` 600 s or 0, which lets a due job preempt a job that
overtook it at once); the `fsp` backfill variant with `min_run` 0. Third round: due jobs
that preempt any job that arrived after them (`guard="arrival"`), with SJF, the tier order
or capped backlog, and with the virtual FIFO re-based on real jobs that overrun
(`due_rebase`): SJF with both is the `fsp` preset now; "fsp before" is the preset as it was
(due jobs block), alone and re-based.

Run: .venv/bin/python benchmarks/scheduler_guards.py [--seed 0] [--variant NAME ...]
(about 15 minutes of CPU for all variants, 1 minute per variant)
"""

from __future__ import annotations

import argparse
import math
import time

from gpucloud.scheduler import POLICIES, EstimateModel, simulate
from gpucloud.scheduler.policies.sjf import Sjf
from gpucloud.scheduler.policies.tiers import Tiers
from gpucloud.scheduler.sim.cluster import parse_cluster
from gpucloud.scheduler.sim.sweep import load_spec, synthetic_traces

TRACES = "/work/shared/traces"
ITP = f"{TRACES}/microsoft_itp_2021/raw/cluster{{:02d}}.csv"
PHILLY = f"{TRACES}/microsoft_philly_2017/philly_jobs_pollux.csv@ee9e8c=16x8"
TUNED = {"cluster01", "cluster03", "philly_jobs_pollux-ee9e8c", "synthetic-diurnal-pareto-3000-s0"}

# the `fsp` preset before issue 18's third round: due jobs preempt only jobs that are not
# due, nothing starts behind a blocked due job, the virtual FIFO ends jobs at their estimate
_fsp_blocking = POLICIES["fsp"].with_(guard="preempt", due_rebase=False)
# the `gpucloud` preset before issue 18's fourth round: the same switches, but GPU-time
# tiers (a job without an estimate in the long tier) and, instead of the due guard, a job
# starves once it has waited the current backlog; starving jobs preempt
_backlog = POLICIES["gpucloud"].with_(
    name="backlog",
    ordering=Tiers((16 * 3600.0,), default_estimate=math.inf),
    due_slack=None,
    guard="preempt",
    due_rebase=False,
    starvation_backlog=1.0,
)
_tiered_due = _backlog.with_(starvation_backlog=None, due_slack=0.0)
_capped = _backlog.with_(due_slack=0.0, due_share=1.0)
VARIANTS = {
    "gpucloud": POLICIES["gpucloud"],
    "gpucloud, jobs without an estimate last": POLICIES["gpucloud"].with_(
        ordering=Sjf(by_gpu_time=True, default_estimate=math.inf)
    ),
    "backlog": _backlog,
    "backlog, guard reserve": _backlog.with_(guard="reserve"),
    "backlog, guard block": _backlog.with_(guard="block"),
    "backlog, starving jobs preempt later arrivals": _backlog.with_(guard="arrival"),
    "backlog + fsp's due guard": _backlog.with_(due_slack=0.0, guard="arrival", due_rebase=True),
    "fsp": POLICIES["fsp"],
    "fsp before: due jobs block, no re-basing": _fsp_blocking,
    "fsp before, re-based": _fsp_blocking.with_(due_rebase=True),
    "fsp, due jobs reserve and others backfill": _fsp_blocking.with_(guard="backfill"),
    "fsp, due times led by the due queue's drain": _fsp_blocking.with_(due_lead=True),
    "fsp, led, due jobs reserve and others backfill": _fsp_blocking.with_(
        due_lead=True, guard="backfill"
    ),
    "backlog, starving at FIFO's longest wait": _backlog.with_(starvation_fifo=1.0),
    "tiers, starving at FIFO's longest wait only": _backlog.with_(
        starvation_backlog=None, starvation_fifo=1.0
    ),
    "backlog + due at FIFO's longest wait": _capped,
    "backlog + due at FIFO's longest wait, led": _capped.with_(due_lead=True),
    "backlog + due at FIFO's longest wait, due jobs reserve": _capped.with_(guard="backfill"),
    "fsp, due jobs reserve and others backfill, min_run 0": _fsp_blocking.with_(
        guard="backfill", min_run=0.0
    ),
    "backlog + due at FIFO's longest wait, due jobs reserve, min_run 0": _capped.with_(
        guard="backfill", min_run=0.0
    ),
    "fsp, due jobs preempt later arrivals": _fsp_blocking.with_(guard="arrival"),
    "tiers + due guard, due jobs preempt later arrivals": _tiered_due.with_(guard="arrival"),
    "tiers + due guard, due jobs preempt later arrivals, re-based": _tiered_due.with_(
        guard="arrival", due_rebase=True
    ),
    "backlog + due at FIFO's longest wait, due jobs preempt later arrivals": _capped.with_(
        guard="arrival"
    ),
    "tiers + due guard": _tiered_due,
    "tiers + due guard, share 0.5": _tiered_due.with_(due_share=0.5),
    "tiers + due guard, share 1.0": _tiered_due.with_(due_share=1.0),
}


def _ratio(x: float, fifo: float) -> float:
    return x / fifo if fifo > 0 else (1.0 if x <= 0 else math.inf)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0, help="seed of the estimate errors")
    ap.add_argument("--variant", action="append", choices=list(VARIANTS),
                    help="only these variants (repeatable); default all")  # fmt: skip
    args = ap.parse_args()
    seed = args.seed
    variants = {k: VARIANTS[k] for k in args.variant or VARIANTS}
    runs = [load_spec(ITP.format(i) + ("=20x8" if i == 3 else ""), 0.875) for i in range(1, 11)]
    runs += [load_spec(PHILLY, 0.875)] + synthetic_traces(list(range(5)), 3000, 0.875)
    t0 = time.process_time()
    rows: dict[str, list[tuple[str, float, float, float]]] = {v: [] for v in variants}
    for trace, cluster in runs:
        nodes = parse_cluster(cluster)
        fifo = simulate(trace, nodes, POLICIES["fifo"], estimates=EstimateModel(), seed=seed)
        f = fifo.summary
        for name, policy in variants.items():
            s = simulate(trace, nodes, policy, estimates=EstimateModel(), seed=seed).summary
            rows[name].append(
                (trace.name, s["avg_jct_s"] / f["avg_jct_s"],
                 _ratio(s["p99_queue_s"], f["p99_queue_s"]),
                 _ratio(s["max_wait_s"], f["max_wait_s"]))
            )  # fmt: skip
    names = [t.name.replace("philly_jobs_pollux-", "philly ") for t, _ in runs]
    print(f"ratios to strict FIFO (avg JCT / p99 wait / max wait), estimate seed {seed}")
    print("| variant | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for name, rs in rows.items():
        print(f"| {name} | " + " | ".join(f"{j:.3f}/{p:.3f}/{m:.3f}" for _, j, p, m in rs) + " |")
    print("\n| variant | traces | holds on | worst p99 | worst max | geo-mean avg JCT |")
    print("|---|---|---|---|---|---|")
    for name, rs in rows.items():
        for label, part in (("tuned", [r for r in rs if r[0] in TUNED]),
                            ("held out", [r for r in rs if r[0] not in TUNED])):  # fmt: skip
            holds = sum(m <= 1.05 and p <= 1.01 for _, _, p, m in part)
            geo = math.exp(sum(math.log(j) for _, j, _, _ in part) / len(part))
            print(
                f"| {name} | {label} | {holds}/{len(part)} | {max(p for *_, p, _ in part):.3f} "
                f"| {max(m for *_, m in part):.3f} | {geo:.3f} |"
            )
    print(f"\n{time.process_time() - t0:.0f} s of CPU")


if __name__ == "__main__":
    main()
