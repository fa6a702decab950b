"""What a replay measures: time integrals while it runs (`Sampler`) and the summary
figures over finished jobs (`summarize`). Definitions are in docs/simulator.md."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from gpucloud.scheduler.fgd import Workload, fgd_fragmentation, task
from gpucloud.scheduler.state import ClusterState, Job

if TYPE_CHECKING:
    from gpucloud.scheduler.sim.simulator import JobRecord, Result

SIZE_CLASSES = ((1, 1, "1"), (2, 4, "2-4"), (5, 8, "5-8"), (9, 32, "9-32"), (33, 10**9, "33+"))
FGD_EVERY = 64  # events between two fragmentation samples on fractional traces


def jain_index(values: list[float]) -> float:
    """Jain's fairness index: 1 when all values are equal, 1/n when one gets everything."""
    sq = sum(v * v for v in values)
    return 1.0 if not values or sq == 0 else sum(values) ** 2 / (len(values) * sq)


class Sampler:
    """Integrates cluster-wide figures between events: GPU-time used, GPUs idle while
    jobs wait, per-tenant fairness; keeps the queue/utilization series for plots."""

    def __init__(self, state: ClusterState, fractional: bool = False) -> None:
        self.state = state
        self.capacity = state.capacity()
        self.used = 0.0
        self.pending = 0
        self.waiting: Counter = Counter()
        self.held: Counter = Counter()
        self.t: float | None = None
        self.start: float | None = None
        self.used_time = self.idle_waiting = self.fair_time = self.fair_sum = 0.0
        self.preemptions = 0
        self.times: list[float] = []
        self.queue: list[int] = []
        self.busy: list[float] = []
        self.fractional = fractional
        self.workload: Counter = Counter()
        self.fgd: list[float] = []
        self._events = 0

    def entitlement(self, tenant: str) -> float:
        t = self.state.tenants.get(tenant)
        if t is not None and sum(t.quota.values()) > 0:
            return sum(t.quota.values())
        weights = sum(x.weight for x in self.state.tenants.values()) or 1.0
        return self.capacity * (t.weight if t else 1.0) / weights

    def advance(self, t: float) -> None:
        if self.t is None:
            self.t = self.start = t
        dt = t - self.t
        if dt > 0:
            self.used_time += self.used * dt
            if self.pending:
                self.idle_waiting += (self.capacity - self.used) * dt
            hungry = [k for k, v in self.waiting.items() if v > 0]
            if len(hungry) >= 2:
                shares = [self.held[k] / self.entitlement(k) for k in hungry]
                self.fair_sum += jain_index(shares) * dt
                self.fair_time += dt
        if not self.times or self.times[-1] != t:
            self.times.append(t)
            self.queue.append(self.pending)
            self.busy.append(self.used)
        else:
            self.queue[-1], self.busy[-1] = self.pending, self.used
        self.t = t
        self._events += 1
        if self.fractional and self._events % FGD_EVERY == 0:
            mix = Workload.from_counts(self.workload)
            self.fgd.append(fgd_fragmentation(self.state, mix))

    def submitted(self, job: Job) -> None:
        self.pending += 1
        self.waiting[job.tenant] += 1
        self.workload[task(job)] += 1

    def started(self, job: Job) -> None:
        self.pending -= 1
        self.waiting[job.tenant] -= 1
        self.used += job.gpus
        self.held[job.tenant] += job.gpus

    def preempted(self, job: Job) -> None:
        self.preemptions += 1
        self.pending += 1
        self.waiting[job.tenant] += 1
        self.used -= job.gpus
        self.held[job.tenant] -= job.gpus

    def stopped(self, job: Job) -> None:
        self.used -= job.gpus
        self.held[job.tenant] -= job.gpus


def _stats(values: list[float], prefix: str) -> dict[str, float]:
    if not values:
        return {f"{k}_{prefix}_s": 0.0 for k in ("avg", "median", "p95", "p99")}
    a = np.asarray(values)
    return {
        f"avg_{prefix}_s": float(a.mean()),
        f"median_{prefix}_s": float(np.median(a)),
        f"p95_{prefix}_s": float(np.percentile(a, 95)),
        f"p99_{prefix}_s": float(np.percentile(a, 99)),
    }


def _group(records: list[JobRecord]) -> dict[str, float]:
    return {
        "jobs": len(records),
        **_stats([r.jct for r in records], "jct"),
        **_stats([r.wait for r in records], "queue"),
        "max_wait_s": max((r.wait for r in records), default=0.0),
    }


def summarize(result: Result) -> dict:
    """The JSON summary of a replay (keys documented in docs/simulator.md)."""
    recs = result.records
    s = result.sampler
    first = min((r.submit for r in recs), default=0.0)
    makespan = max((r.end for r in recs), default=0.0) - first
    cap_time = result.capacity * makespan or 1.0
    by_tenant: dict[str, list[JobRecord]] = {}
    by_size: dict[str, list[JobRecord]] = {}
    for r in recs:
        by_tenant.setdefault(r.tenant, []).append(r)
        label = next(lab for lo, hi, lab in SIZE_CLASSES if lo <= r.num_gpus <= hi)
        by_size.setdefault(label, []).append(r)
    out = {
        "policy": result.policy,
        "trace": result.trace,
        "cluster": result.cluster,
        **_group(recs),
        "skipped": sum(result.skipped.values()),
        "skipped_reasons": dict(result.skipped),
        "makespan_s": makespan,
        "utilization": s.used_time / cap_time,
        "fragmentation": s.idle_waiting / cap_time,
        "preemptions": s.preemptions,
        "gpu_hours_lost": sum(r.lost_gpu_seconds for r in recs) / 3600,
        "jain_fairness": s.fair_sum / s.fair_time if s.fair_time else 1.0,
        "per_tenant": {k: _group(v) for k, v in sorted(by_tenant.items())},
        "per_size": {lab: _group(by_size[lab]) for _, _, lab in SIZE_CLASSES if lab in by_size},
    }
    if s.fgd:
        out["fgd_fragmentation_gpus"] = float(np.mean(s.fgd))
    return out
