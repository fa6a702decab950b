"""Discrete-event replay of a trace through the scheduler core.

Each event time: finish the jobs whose true remaining run time has elapsed, submit the
jobs that arrive, then run one scheduling pass (`Scheduler.schedule`, the same call the
control plane makes) and schedule the completions of the jobs it started. Policies whose
decisions change with time alone (preemption, reclaim, starvation) also get a pass every
`tick` seconds while jobs wait. Deterministic: the only randomness is the estimate error,
drawn from `seed`. docs/simulator.md gives the exact semantics.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from gpucloud.errors import UserError
from gpucloud.scheduler.core import Scheduler
from gpucloud.scheduler.policies import Policy
from gpucloud.scheduler.sim.cluster import describe, empty_state
from gpucloud.scheduler.sim.metrics import Sampler, summarize
from gpucloud.scheduler.sim.traces import Trace, TraceJob
from gpucloud.scheduler.state import MILLI, ClusterState, Job, Node, Tenant


@dataclass(frozen=True, slots=True)
class EstimateModel:
    """What users tell the scheduler: estimate = true duration x exp(N(0, sigma)), and no
    estimate at all with probability `missing`. A trace's own estimates are kept."""

    sigma: float = 1.0
    missing: float = 0.1

    def draw(self, jobs: list[TraceJob], seed: int) -> list[float | None]:
        rng = np.random.default_rng(seed)
        factor = np.exp(rng.normal(0.0, self.sigma, len(jobs)))
        gone = rng.random(len(jobs)) < self.missing
        return [
            j.estimate if j.estimate is not None else None if gone[i] else j.duration * factor[i]
            for i, j in enumerate(jobs)
        ]


@dataclass(slots=True)
class JobRecord:
    id: str
    tenant: str
    num_gpus: int
    gpus: float
    submit: float
    first_start: float
    end: float
    duration: float
    preemptions: int
    lost_gpu_seconds: float

    @property
    def jct(self) -> float:
        return self.end - self.submit

    @property
    def wait(self) -> float:
        """Time not spent on useful work: queueing, preempted and re-run time."""
        return self.jct - self.duration


@dataclass(slots=True)
class Result:
    policy: str
    trace: str
    cluster: str
    capacity: int
    records: list[JobRecord]
    skipped: Counter
    sampler: Sampler
    summary: dict = field(default_factory=dict)


def default_tenants(trace: Trace, capacity: dict[str, int]) -> list[Tenant]:
    """One cohort; each tenant's guaranteed quota is its share of the trace's GPU-time,
    so the quotas add up to the cluster, and every tenant may borrow idle quota."""
    work = Counter()
    for j in trace.jobs:
        work[j.tenant] += j.num_gpus * j.gpu_milli / MILLI * j.duration
    total = sum(work.values()) or 1.0
    return [Tenant(t, {g: c * work[t] / total for g, c in capacity.items()}) for t in sorted(work)]


def simulate(
    trace: Trace,
    nodes: list[Node],
    policy: Policy,
    *,
    tenants: list[Tenant] | None = None,
    estimates: EstimateModel = EstimateModel(),
    checkpoint_interval: float | None = 1800.0,
    tick: float = 300.0,
    default_estimate: float = 3600.0,
    seed: int = 0,
) -> Result:
    """Replay `trace` on `nodes` under `policy`; every replayable job runs to completion.

    Jobs larger than every pool they may use are skipped and counted in `Result.skipped`.
    Raises UserError if jobs remain that can never start (e.g. a quota of zero).
    """
    state = empty_state(nodes, default_estimate)
    capacity = {t: p.total for t, p in state.pools.items()}
    for t in tenants if tenants is not None else default_tenants(trace, capacity):
        state.add_tenant(t)
    skipped = Counter(trace.skipped)
    ests = estimates.draw(trace.jobs, seed)
    arrivals: list[Job] = []
    largest = max(capacity.values())
    for tj, est in zip(trace.jobs, ests, strict=True):
        if tj.num_gpus > largest:
            skipped[f"larger than the largest pool ({largest} GPUs)"] += 1
            continue
        job = _job(tj, est, checkpoint_interval)
        if not state.hostable(job):
            skipped["more CPU or memory than any node that could hold it has"] += 1
            continue
        arrivals.append(job)
    return _run(state, arrivals, policy, trace.name, describe(nodes), skipped, tick)


def _job(tj: TraceJob, estimate: float | None, ckpt: float | None) -> Job:
    return Job(
        tj.id,
        tenant=tj.tenant,
        num_gpus=tj.num_gpus,
        gpu_milli=tj.gpu_milli,
        gpu_types=tj.gpu_types,
        priority=tj.priority,
        preemptible=tj.preemptible,
        submit_time=tj.submit_time,
        estimate=estimate,
        duration=tj.duration,
        checkpoint_interval=ckpt,
        cpu_milli=tj.cpu_milli,
        memory_mib=tj.memory_mib,
    )


def _run(
    state: ClusterState,
    arrivals: list[Job],
    policy: Policy,
    trace_name: str,
    cluster: str,
    skipped: Counter,
    tick: float,
) -> Result:
    scheduler = Scheduler(policy)
    timed = policy.preempt or policy.reclaim or policy.guarded
    sampler = Sampler(state, fractional=any(j.gpu_milli < MILLI for j in arrivals))
    ends: list[tuple[float, int, Job, int]] = []  # (end, seq, job, preemptions at start)
    records: list[JobRecord] = []
    i, n = 0, len(arrivals)
    now = arrivals[0].submit_time if arrivals else 0.0
    next_tick = math.inf
    while i < n or ends or state.pending:
        t = min(
            arrivals[i].submit_time if i < n else math.inf,
            ends[0][0] if ends else math.inf,
            next_tick,
        )
        sampler.advance(t)
        now = t
        while ends and ends[0][0] <= now:
            _, _, job, run = heapq.heappop(ends)
            if job.preemptions != run:
                continue  # preempted since: this completion is stale
            state.finish(job, now)
            sampler.stopped(job)
            records.append(_record(job, now))
        while i < n and arrivals[i].submit_time <= now:
            state.submit(arrivals[i])
            sampler.submitted(arrivals[i])
            i += 1
        d = scheduler.schedule(state, now)
        if state.pending and not (d.starts or state.running or i < n):
            raise UserError(
                f"{len(state.pending)} jobs can never start under {policy.name} "
                f"(e.g. {next(iter(state.pending))}: larger than its quota allows)"
            )
        for job in d.preemptions:
            sampler.preempted(job)
        for job, _ in d.starts:
            sampler.started(job)
            rest = (job.duration or 0.0) - job.progress
            heapq.heappush(ends, (now + rest, job.seq, job, job.preemptions))
        next_tick = now + tick if timed and state.pending else math.inf
    sampler.advance(now)
    result = Result(policy.name, trace_name, cluster, state.capacity(), records, skipped, sampler)
    result.summary = summarize(result)
    return result


def _record(job: Job, now: float) -> JobRecord:
    return JobRecord(
        job.id,
        job.tenant,
        job.num_gpus,
        job.gpus,
        job.submit_time,
        job.first_start if job.first_start is not None else now,
        now,
        job.duration or 0.0,
        job.preemptions,
        job.lost_gpu_seconds,
    )
