"""The scheduling pass: `Scheduler(policy).schedule(state, now) -> Decisions`.

How to use it (the control plane's reconciler and the simulator do exactly this):

    from gpucloud.scheduler import ClusterState, Node, Tenant, Job, Scheduler, POLICIES

    state = ClusterState()
    state.add_node(Node("gpu-01", "H100-SXM", 8, rack="r1"))        # once per node
    state.add_tenant(Tenant("research", quota={"H100-SXM": 8}))      # optional quotas
    state.submit(Job("j1", tenant="research", num_gpus=4, estimate=3600, submit_time=t0))
    # jobs already running (e.g. rebuilt from the database): submit, then
    # state.start(job, Allocation(...), job_start_time)
    decisions = Scheduler(POLICIES["gpucloud"]).schedule(state, now)
    for job in decisions.preemptions: ...   # stop these (they are PENDING again)
    for job, alloc in decisions.starts: ... # run job on alloc.parts [(node, GPU indices)]
    # later: state.finish(job, now) when its process exits; state.cancel(job, now)

`schedule` applies its decisions to `state` (jobs move to RUNNING or back to PENDING, the
free-GPU indexes update) and returns them. It reads no clock and does no I/O: `now` is the
caller's. Preemptions come before the starts that needed them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from gpucloud.scheduler.placement import fits, place
from gpucloud.scheduler.policies import Policy
from gpucloud.scheduler.policies.backfill import Reservation, reserve
from gpucloud.scheduler.policies.due import VirtualFifo
from gpucloud.scheduler.policies.fifo import Fifo
from gpucloud.scheduler.policies.preemption import choose_victims
from gpucloud.scheduler.policies.quota import Admission, admit, is_borrowing
from gpucloud.scheduler.state import MILLI, Allocation, ClusterState, Job, JobState


class Wait(StrEnum):
    """Why a pending job the pass looked at did not start (as Slurm's pending reasons)."""

    QUOTA = "waiting for its tenant's quota"
    GPUS = "waiting for free GPUs"
    HOST = "waiting for CPU or memory on a node with free GPUs"
    RESERVED = "the free GPUs are held for an earlier job"
    ORDER = "queued behind earlier jobs"  # not looked at: the pass stopped before it


class Cause(StrEnum):
    """Why a running job was preempted."""

    PRIORITY = "priority"  # a job of a better rank (priority class, LAS queue)
    RECLAIM = "reclaim"  # it ran on borrowed quota, which the lender's job takes back
    GUARD = "guard"  # a starving or due job (the wait guard)


@dataclass
class Decisions:
    """What one pass did, already applied to the state: preempted jobs are PENDING again,
    `preempted_for` says for which job and why (victim id -> (cause, that job));
    `reservation` is the EASY reservation the pass made (None if none); `waiting`, when
    the scheduler explains, why each pending job it looked at did not start."""

    starts: list[tuple[Job, Allocation]] = field(default_factory=list)
    preemptions: list[Job] = field(default_factory=list)
    preempted_for: dict[str, tuple[Cause, Job]] = field(default_factory=dict)
    reservation: Reservation | None = None
    waiting: dict[str, Wait] = field(default_factory=dict)


class Scheduler:
    def __init__(self, policy: Policy, explain: bool = False) -> None:
        """`explain`: fill `Decisions.waiting` (the control plane shows it; the simulator
        does without the cost)."""
        self.policy = policy
        self.explain = explain
        self._virtual: VirtualFifo | None = None
        self._limit = math.inf  # starvation limit of the current pass

    def schedule(self, state: ClusterState, now: float) -> Decisions:
        """Start what the policy allows now, preempting where it must. See the module doc."""
        p = self.policy
        d = Decisions()
        blocked = tries = 0
        can_preempt = p.preempt or p.reclaim or p.guarded and p.guard in _PREEMPTING
        self._virtual = None
        if p.due_slack is not None or p.starvation_fifo is not None:
            self._virtual = state.extras.get(VirtualFifo)
            if self._virtual is None:
                self._virtual = state.extras[VirtualFifo] = VirtualFifo(
                    state.capacity(), p.due_rebase
                )
            self._virtual.advance(state, now)
            if p.due_lead and p.due_slack is not None:
                self._virtual.run_ahead(state, now, p.due_slack, p.due_share)
        self._limit = _starvation_limit(p, state, now, self._virtual)
        for job in self._candidates(state, now):
            if job.state is not JobState.PENDING or job.preemptions and job in d.preemptions:
                continue  # started, or preempted, earlier in this pass
            if not (can_preempt or _any_free(state)):
                if self.explain:
                    d.waiting[job.id] = Wait.GPUS
                break
            types, startable = self._admissible(state, job)
            free = [t for t in startable if fits(state, job, t)]
            if free and self._try_start(state, job, free, now, d):
                continue
            if can_preempt and types and tries < p.preempt_tries and d.reservation is None:
                tries += 1
                if job.gpu_milli == MILLI and self._preempt_for(state, job, types, now, d):
                    continue
            if self.explain:
                d.waiting[job.id] = _why(state, job, startable, free, d.reservation)
            if types and p.backfill == "none":
                break  # strict order; a job over its quota waits without blocking others
            if (
                types
                and (p.due_slack is not None and p.guard not in _BACKFILLING or p.guard == "block")
                and self._guarded(job, now)
            ):
                # Behind a blocked due job nothing starts, as under FIFO: backfilled jobs
                # on wrong estimates could overrun its reservation, and once they are due
                # themselves they cannot be preempted for it.
                break
            if types and p.backfill == "easy" and d.reservation is None:
                d.reservation = reserve(state, job, types, now, p.placement.consolidate)
            blocked += 1
            if blocked >= p.backfill_depth:
                break
        return d

    def _candidates(self, state: ClusterState, now: float) -> Iterator[Job]:
        """Starving or due jobs first (arrival order), then the policy's order."""
        p = self.policy
        order = p.ordering.order(state, now)
        if not p.guarded:
            yield from order
            return
        first: list[Job] = []
        # Both guards only ever hold a prefix-like set of the arrival order: stop at the
        # first job too young to starve and not yet due, and look at a bounded number.
        limit = self._limit
        for job in state.queue("fifo", Fifo.key).head():
            due = (
                p.due_slack is not None
                and self._virtual is not None
                and self._virtual.due(job, now, p.due_slack or 0.0, p.due_share)
            )
            if now - job.submit_time < limit and not due:
                break
            if due or self._starving(job, now):
                first.append(job)
                if len(first) >= _MAX_GUARDED:
                    break
        yield from first
        guarded = {j.id for j in first}
        yield from (j for j in order if j.id not in guarded)

    def _admissible(self, state: ClusterState, job: Job) -> tuple[list[str], list[str]]:
        """(pools the job may wait for, pools its quota lets it start in now)."""
        types = state.pool_types(job)
        if not self.policy.quotas:
            return types, types
        verdict = {t: admit(state, job, t) for t in types}
        return (
            [t for t in types if verdict[t] is not Admission.WAIT],
            [t for t in types if verdict[t] in (Admission.WITHIN, Admission.BORROW)],
        )

    def _try_start(
        self, state: ClusterState, job: Job, types: list[str], now: float, d: Decisions
    ) -> bool:
        res = d.reservation
        for t in types:
            avoid = None
            if res is not None and not res.allows(state, job, t, now):
                avoid = res.avoid(t)
                if avoid is None:
                    continue
            alloc = place(state, job, t, self.policy.placement, avoid)
            if alloc is not None:
                state.start(job, alloc, now)
                d.starts.append((job, alloc))
                v = self._virtual
                if v is not None and self.policy.due_slack is not None and not self._by_arrival:
                    if not self._guarded(job, now):
                        v.overtakers[job.id] = job  # in start order: the youngest last
                    else:
                        v.overtakers.pop(job.id, None)  # restarted when due: protected
                if res is not None:
                    res.started(state, job, t, now)
                return True
        return False

    def _preempt_for(
        self, state: ClusterState, job: Job, types: list[str], now: float, d: Decisions
    ) -> bool:
        p = self.policy
        rank = p.ordering.rank(job, now)
        starving = p.guard in _PREEMPTING and self._guarded(job, now)
        within = {t: not p.quotas or admit(state, job, t) is Admission.WITHIN for t in types}
        lenders = {
            t: p.reclaim
            and within[t]
            and any(is_borrowing(state, other, t) for other in state.tenants if other != job.tenant)
            for t in types
        }
        if not (starving or p.preempt or any(lenders.values())):
            return False  # nobody could be a victim: skip the scan of running jobs

        def cause(r: Job, t: str) -> Cause | None:
            """Why `r` may be preempted for `job` in pool `t` (None: it may not)."""
            # never a job started in this pass (even with min_run 0), nor a younger one
            young = r.start_time is None or r.start_time >= now or now - r.start_time < p.min_run
            if young or self._protected(r, now, job if starving else None):
                return None
            if starving:
                return Cause.GUARD
            if p.preempt and p.ordering.rank(r, now) > rank:
                return Cause.PRIORITY
            if lenders[t] and r.tenant != job.tenant and is_borrowing(state, r.tenant, t):
                return Cause.RECLAIM
            return None

        among = None
        v = self._virtual
        if self._by_arrival and starving:
            among = [r for r in reversed(state.running.values()) if r.seq > job.seq]
        elif v is not None and self._limit == math.inf and not (p.preempt or any(lenders.values())):
            # Only the due guard can preempt here, and its victims are jobs that started
            # before they were due: walk those few instead of every running job.
            v.overtakers = {
                r.id: r
                for r in v.overtakers.values()
                if r.state is JobState.RUNNING and not self._protected(r, now)
            }
            among = list(reversed(v.overtakers.values()))
        for t in types:
            per_node = p.placement.consolidate and job.num_gpus <= state.pools[t].max_node
            victims = choose_victims(
                state, job, t, lambda r, t=t: cause(r, t) is not None, per_node, among
            )
            if not victims:
                continue
            if p.quotas:
                freed: dict[str, float] = {}
                for r in victims:
                    freed[r.tenant] = freed.get(r.tenant, 0.0) + r.gpus
                if admit(state, job, t, freed) not in (Admission.WITHIN, Admission.BORROW):
                    continue  # GPUs freed, but not quota: the job still could not start
            causes = [cause(v, t) for v in victims]  # before any is preempted
            for v, why in zip(victims, causes, strict=True):
                state.preempt(v, now)
                d.preemptions.append(v)
                d.preempted_for[v.id] = (why, job)
            startable = self._admissible(state, job)[1]
            if t in startable and self._try_start(state, job, [t], now, d):
                return True
        return False

    @property
    def _by_arrival(self) -> bool:
        """Guard "arrival": a guarded job's victims are the jobs that arrived after it
        (no record of who overtook whom is needed)."""
        return self.policy.guard == "arrival"

    def _guarded(self, job: Job, now: float) -> bool:
        """Starving or due: may preempt unguarded jobs and is never preempted itself."""
        v, slack = self._virtual, self.policy.due_slack
        if v is not None and slack is not None and v.due(job, now, slack, self.policy.due_share):
            return True
        return self._starving(job, now)

    def _protected(self, running: Job, now: float, guarded: Job | None = None) -> bool:
        """Whether a running job may not be a guard's victim: it started when due (under
        guard "backfill"), or is due or starving now (other guards); under guard
        "arrival", for a `guarded` job, it arrived before that job."""
        v = self._virtual
        if self._by_arrival and guarded is not None:
            return running.seq < guarded.seq
        if self.policy.guard == "backfill" and v is not None and self.policy.due_slack is not None:
            return running.id not in v.overtakers
        return self._guarded(running, now)

    def _starving(self, job: Job, now: float) -> bool:
        if self._limit == math.inf:
            return False
        return _waited(job, now) >= self._limit


_PREEMPTING = ("preempt", "backfill", "arrival")  # guards whose jobs may preempt
_BACKFILLING = ("backfill", "arrival")  # due guards that reserve instead of blocking

# Guarded jobs put first in one pass; more would make a pass O(queue) when many are due,
# and a pass only ever starts or reserves for the first few blocked ones anyway.
_MAX_GUARDED = 256


def _starvation_limit(
    p: Policy, state: ClusterState, now: float, virtual: VirtualFifo | None
) -> float:
    """Seconds of waiting after which a job starves in this pass (inf: never)."""
    floor = p.starvation_after
    limit = math.inf
    if p.starvation_backlog is not None:
        cached = state.extras.get(_BacklogCache)
        if cached is None or not 0 <= now - cached.at < _BACKLOG_REFRESH:
            cached = state.extras[_BacklogCache] = _BacklogCache(now, backlog(state, now))
        limit = p.starvation_backlog * cached.seconds
    if p.starvation_fifo is not None and virtual is not None:
        limit = min(limit, p.starvation_fifo * virtual.longest_wait(state, now))
    if limit == math.inf:
        return floor if floor is not None else math.inf
    return max(limit, floor or 0.0)


# The backlog moves on the scale of hours and costs O(pending + running) to sum: a pass
# reuses the value computed up to this many seconds earlier.
_BACKLOG_REFRESH = 300.0


@dataclass(frozen=True, slots=True)
class _BacklogCache:
    at: float
    seconds: float


def backlog(state: ClusterState, now: float) -> float:
    """Seconds the whole cluster needs to run the believed remaining work of all pending
    and running jobs: estimates (the state's default if none) times the calibration
    observed so far (run time / estimate over ended jobs); an overrun job counts as
    ending now. O(pending + running) per call."""
    calib = state.estimate_calibration
    default = state.default_estimate
    work = sum(j.remaining_estimate(default) * j.gpus for j in state.pending.values()) * calib
    for j in state.running.values():
        ran = now - j.start_time if j.start_time is not None else 0.0
        work += max(j.remaining_estimate(default) * calib - ran, 0.0) * j.gpus
    return work / max(state.capacity(), 1)


def _waited(job: Job, now: float) -> float:
    """Seconds `job` has waited so far: since submit, minus the useful work it kept (work
    lost to preemption counts as waiting, as in the metrics)."""
    current = now - job.start_time if job.start_time is not None else 0.0
    return now - job.submit_time - job.run_time - current


def _why(
    state: ClusterState, job: Job, startable: list[str], free: list[str], res: Reservation | None
) -> Wait:
    """The first thing that kept `job` from starting: its quota, the free GPU count, the
    host resources of the nodes that have its GPUs free, or a reservation."""
    if not startable:
        return Wait.QUOTA
    if not free:
        return Wait.GPUS
    if job.cpu_milli or job.memory_mib:
        types = [t for t in free if job.num_gpus <= state.pools[t].max_node]
        roomy = [
            n
            for n in state.node_list
            if n.gpu_type in types and not n.cordoned and n.free_whole >= job.num_gpus
        ]
        if roomy and not any(n.hosts(job, job.num_gpus) for n in roomy):
            return Wait.HOST
    return Wait.RESERVED if res is not None and res.job is not job else Wait.GPUS


def _any_free(state: ClusterState) -> bool:
    return any(p.free_whole or p.shared for p in state.pools.values())
