"""The reconciler's view of the store as the scheduler core's `ClusterState`.

Scheduler job ids are workload references (`job-N`, `replica-N`). A cordoned or draining
node keeps its running work and is cordoned in the core too, so nothing new is placed on
it; a node that is down holds nothing the core could hand out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpucloud.control.executors.base import WorkloadKind, WorkloadRef
from gpucloud.control.lifecycle import (
    PRIORITIES,
    REPLICA_HOLDS_GPUS,
    JobState,
    NodeState,
    ReplicaState,
)
from gpucloud.control.models import Deployment, Job, Node, Quota, Replica, Tenant, User
from gpucloud.control.services import budgets
from gpucloud.errors import CapacityError
from gpucloud.scheduler import Allocation, ClusterState
from gpucloud.scheduler import Job as SJob
from gpucloud.scheduler import Node as SNode
from gpucloud.scheduler import Tenant as STenant
from gpucloud.scheduler.state import JobState as SJobState


@dataclass
class Snapshot:
    state: ClusterState
    nodes: dict[str, int] = field(default_factory=dict)  # name -> node id
    gpu_types: dict[str, str] = field(default_factory=dict)  # name -> its GPU type
    workloads: int = 0  # jobs and replicas running or pending
    # each pending job: (its row, its scheduler id, the reason the store has for its wait)
    pending: list[tuple[tuple, str, str | None]] = field(default_factory=list)
    no_pool: set[str] = field(default_factory=set)  # pending, but no node of its type is up
    held: dict[str, str] = field(default_factory=dict)  # pending, kept out: ref -> reason
    over_budget: dict[int, str] = field(default_factory=dict)  # running jobs a budget stops
    crossings: list[budgets.Crossing] = field(default_factory=list)  # not audited yet


def load(session: Session) -> Snapshot:
    """The cluster state as the store has it now, built anew (the console's projection)."""
    return LiveCluster().load(session, time.time())


class LiveCluster:
    """The reconciler's `ClusterState`, kept between passes and brought up to date with
    the store at the start of each, as Kueue keeps its cache: jobs that arrived are
    submitted, jobs that started elsewhere (adopted) are started, jobs that ended leave it
    (`finish`, with the run time they had, so estimates are calibrated), jobs requeued go
    back to the queue (`preempt`: their arrival order stays), and the starts and
    preemptions of the last pass's decisions that the store does not show are undone the
    same ways. So the scheduler sees on the live cluster what it sees in the simulator: one
    state over time, with the bookkeeping policies keep in it (the due-time guard's
    virtual FIFO, the queues sorted once). A pass over an unchanged queue of 10,000 jobs
    reads their ids, compares, and builds nothing.

    The state is built anew when a node or tenant changes (a node registered, down or
    back, a quota changed: rare, and capacity changes reach every index), and when it
    remembers more than `_ARRIVALS_KEPT` ended jobs beyond the work it holds (the record
    of arrivals the virtual FIFO reads grows with every job). A job's estimate is the one
    it got when its row was read (its queue position follows it), and changes when the
    row is read again (a new attempt) or, for a job estimated by its tenant's history,
    when that history moves (a job of the tenant succeeded).
    """

    def __init__(self) -> None:
        self.state: ClusterState | None = None
        self._rows = PendingRows()
        self._built_from: tuple = ()  # the node and tenant rows the state was built from
        # the last pass's queue: jobs' and replicas' rows, by scheduler id
        self._waiting: tuple[dict[str, tuple], dict[str, object]] = ({}, {})
        self._no_pool: set[str] = set()  # pending, but no pool of the state could hold them
        self._history: dict[int, float] = {}  # tenant id -> mean run time, last pass

    def load(self, session: Session, now: float) -> Snapshot:
        conn = session.connection()
        nodes = conn.execute(
            select(Node.id, Node.name, Node.gpu_type, Node.gpus, Node.link_domain,
                   Node.cpu_milli, Node.memory_mib, Node.state)
            .where(Node.state != NodeState.DOWN)
            .order_by(Node.id)
        ).all()  # fmt: skip
        tenants = _tenant_rows(session)
        built_from = (tuple(tuple(n)[1:7] for n in nodes), tenants)
        state = self.state
        if state is None or built_from != self._built_from or self._outgrown(state):
            state = self.state = ClusterState()
            for n in nodes:
                state.add_node(SNode(n.name, n.gpu_type, n.gpus, domain_size=n.link_domain,
                                     cpu_milli=n.cpu_milli, memory_mib=n.memory_mib))  # fmt: skip
            _add_tenants(state, tenants)
            self._built_from, self._waiting, self._no_pool = built_from, ({}, {}), set()
        snap = Snapshot(state)
        for n in nodes:
            snap.nodes[n.name] = n.id
            snap.gpu_types[n.name] = n.gpu_type
            if n.state in (NodeState.CORDONED, NodeState.DRAINING):
                state.cordon(n.name)
            else:
                state.uncordon(n.name)
        tenant_names = dict(conn.execute(select(Tenant.id, Tenant.name)).all())
        _hold_over_budget(session, snap, now)

        # What the store runs (on nodes that are up) and what waits, by scheduler id.
        # Running jobs with their devices, pending ones without: decoding 10,000 empty
        # JSON lists was half of a pass at that queue length.
        history = _run_time_history(session)
        # tenants whose history moved: their pending jobs estimated by it are re-estimated
        rehistoried = {t for t in history.keys() | self._history.keys()
                       if history.get(t) != self._history.get(t)}  # fmt: skip
        self._history = history
        make_job = partial(_job, tenant_names, history)
        make_replica = partial(_replica, tenant_names)
        runs: dict[str, tuple] = {}  # id -> (row, its maker, parts, milli, start)
        running = conn.execute(
            select(*_JOB_COLUMNS, Job.placement, Job.started_at)
            .where(Job.state == JobState.RUNNING)
            .order_by(Job.id)
        ).all()
        for row in running:
            _want_run(runs, snap, str(WorkloadRef.job(row[0])), row, make_job, row[3])
        snap.pending, fresh = self._rows.read(conn)
        waiting = {sid: row for row, sid, _ in snap.pending if sid not in snap.held}
        replicas: dict[str, object] = {}  # pending replicas' rows
        reps = conn.execute(
            select(Replica.id, Replica.state, Replica.placement, Replica.started_at,
                   Replica.created_at, Deployment.tenant_id, Deployment.gpus_per_replica,
                   Deployment.gpu_milli, Deployment.gpu_type, Deployment.priority,
                   Deployment.preemptible, Deployment.cpu_milli, Deployment.memory_mib)
            .join(Deployment, Replica.deployment_id == Deployment.id)
            .where(Replica.state.in_((ReplicaState.PENDING, *REPLICA_HOLDS_GPUS)))
            .order_by(Replica.id)
        ).all()  # fmt: skip
        for rep in reps:
            sid = str(WorkloadRef.replica(rep.id))
            if rep.state in REPLICA_HOLDS_GPUS:
                _want_run(runs, snap, sid, rep, make_replica, rep.gpu_milli)
            elif sid not in snap.held:
                replicas[sid] = rep
        snap.workloads = len(running) + len(snap.pending) + len(reps)

        # what came to the queue, or changed there, since the last pass
        last_jobs, last_replicas = self._waiting
        new_jobs = (waiting.keys() - last_jobs.keys()) | (fresh & waiting.keys())
        new_replicas = {sid for sid, rep in replicas.items() if last_replicas.get(sid) != rep}
        try:
            self._follow(session, state, runs, (waiting, replicas), now)
            if rehistoried:
                self._reestimate(state, waiting, new_jobs, history, rehistoried)
            self._arrive(state, waiting, new_jobs, make_job, True, now)
            self._arrive(state, replicas, new_replicas, make_replica, False, now)
            if len(state.pending) != len(waiting) + len(replicas) - len(self._no_pool):
                _drop_strays(state, waiting, replicas, now)
        except Exception:
            self.state = None  # half brought up to date: the next pass builds it anew
            raise
        self._waiting = (waiting, replicas)
        snap.no_pool = set(self._no_pool)
        return snap

    def _follow(self, session: Session, state: ClusterState, runs: dict,
                waiting: tuple[dict, dict], now: float) -> None:  # fmt: skip
        """Bring `state`'s running work to what the store runs, and take out of it what
        left the queue. The last pass's decisions changed only running work (a start or
        a preemption), so the store's queue is compared with the last pass's, not with
        the state's: at 10,000 pending jobs a steady pass looks at no pending job."""
        jobs, replicas = waiting
        ended: list[SJob] = []
        for sid, job in list(state.running.items()):
            want = runs.get(sid)
            if want is not None and job.allocation.parts == want[2]:
                continue
            if want is not None or sid in jobs or sid in replicas:
                state.preempt(job, now)  # requeued, or moved: started again below
            else:
                ended.append(job)
        last_jobs, last_replicas = self._waiting
        for sid in (last_jobs.keys() - jobs.keys()) | (last_replicas.keys() - replicas.keys()):
            self._no_pool.discard(sid)
            job = state.jobs.get(sid)
            if job is not None and job.state is SJobState.PENDING and sid not in runs:
                state.forget(job, now)  # cancelled, held by a budget, or deleted
        _end(session, state, ended, now)
        for sid, (row, make, parts, milli, started) in runs.items():
            job = state.jobs.get(sid)
            if job is not None and job.state is SJobState.RUNNING:
                continue
            if job is None:
                try:
                    job = state.submit(make(row))
                except CapacityError:
                    continue  # no pool of its type now: it holds nothing the core hands out
            state.start(job, Allocation(state.nodes[parts[0][0]].gpu_type, parts, milli), started)

    def _arrive(self, state: ClusterState, waiting: dict, new: set[str], make,
                in_place: bool, now: float) -> None:  # fmt: skip
        """Submit what is new to the queue, in the store's order (their arrival order).
        A job the state still has pending (requeued, its row read again) is updated in
        place, keeping its arrival; a replica, built from its deployment, anew."""
        if not new:
            return
        for sid, row in waiting.items():
            if sid not in new:
                continue
            job = state.jobs.get(sid)
            if job is not None and job.state is SJobState.PENDING and in_place:
                fresh = make(row)
                state.update(job, fresh.estimate, fresh.avoid_nodes)
                continue
            if job is not None:
                state.forget(job, now)
            try:
                state.submit(make(row))
            except CapacityError:
                self._no_pool.add(sid)  # no pool of its type now (a node went down): it waits

    def _reestimate(self, state: ClusterState, waiting: dict, new: set[str],
                    history: dict[int, float], tenants: set[int]) -> None:  # fmt: skip
        """Pending jobs of the tenants in `tenants`, whose history moved, are estimated
        again (those with a time limit or a plan keep theirs)."""
        for sid, row in waiting.items():
            if sid in new or row[1] not in tenants:
                continue
            job = state.jobs.get(sid)
            estimate = _estimate(row, history)
            if job is not None and job.state is SJobState.PENDING and job.estimate != estimate:
                state.update(job, estimate, job.avoid_nodes)

    def _outgrown(self, state: ClusterState) -> bool:
        return len(state.arrived) > len(state.pending) + len(state.running) + _ARRIVALS_KEPT


# Ended jobs a kept state remembers (the virtual FIFO's record of arrivals) before it is
# built anew: a few hundred bytes each.
_ARRIVALS_KEPT = 50_000


def _drop_strays(state: ClusterState, jobs: dict, replicas: dict, now: float) -> None:
    """Forget the jobs pending in `state` that the store does not have pending: a victim
    of the last pass's preemptions that the store has in neither queue (its stop failed
    half-way, say). Only looked for when the counts differ."""
    for sid, job in list(state.pending.items()):
        if sid not in jobs and sid not in replicas:
            state.forget(job, now)


def _want_run(runs: dict, snap: Snapshot, sid: str, row, make, milli: int) -> None:
    """Note a workload the store runs, if every node of its placement is up (one on a node
    that is down holds no GPUs the scheduler can hand out)."""
    placement = row.placement
    if placement and all(p["node"] in snap.gpu_types for p in placement):
        parts = tuple((p["node"], tuple(p["devices"])) for p in placement)
        runs[sid] = (row, make, parts, milli, row.started_at)


def _end(session: Session, state: ClusterState, jobs: list[SJob], now: float) -> None:
    """Take out of `state` the running jobs the store no longer runs: the ones that ended
    finish at the time they did (their run time calibrates estimates); the others
    (cancelled, deleted, their node gone) are forgotten."""
    ids = [WorkloadRef.parse(j.id) for j in jobs]
    job_ids = [ref.id for ref in ids if ref.kind == WorkloadKind.JOB]
    ends = {}
    if job_ids:
        ends = {
            jid: (st, at)
            for jid, st, at in session.connection().execute(
                select(Job.id, Job.state, Job.finished_at).where(Job.id.in_(job_ids))
            )
        }
    for job, ref in zip(jobs, ids, strict=True):
        st, at = ends.get(ref.id, (None, None)) if ref.kind == WorkloadKind.JOB else (None, None)
        if st in _ENDED and at is not None:
            state.finish(job, max(at, job.start_time), _ENDED[st])
        state.forget(job, now)


_ENDED = {JobState.SUCCEEDED: SJobState.SUCCEEDED, JobState.FAILED: SJobState.FAILED}


def _job(tenant_names: dict[int, str], history: dict[int, float], row: tuple) -> SJob:
    """The scheduler's job for a row of `_JOB_COLUMNS`."""
    (jid, tid, gpus, milli, gtype, prio, pre, at, cpu, mem, _, _, avoid) = row[:13]
    return SJob(str(WorkloadRef.job(jid)), tenant_names[tid], gpus, gpu_milli=milli,
                gpu_types=(gtype,) if gtype else (), priority=PRIORITIES[prio],
                preemptible=pre, submit_time=at, cpu_milli=cpu, memory_mib=mem,
                estimate=_estimate(row, history), avoid_nodes=frozenset(avoid or ()))  # fmt: skip


def _estimate(row: tuple, history: dict[int, float]) -> float | None:
    """The scheduler's estimate of a `_JOB_COLUMNS` row (what backfill and SJF plan
    around): its time limit, which is enforced, else the planner's run time for a train
    job, else how long its tenant's jobs have run."""
    tid, limit, planned = row[1], row[10], row[11]
    return limit or planned or history.get(tid)


def _replica(tenant_names: dict[int, str], rep) -> SJob:
    """The scheduler's job for a replica's row (its deployment's request)."""
    return SJob(str(WorkloadRef.replica(rep.id)), tenant_names[rep.tenant_id],
                rep.gpus_per_replica, gpu_milli=rep.gpu_milli,
                gpu_types=(rep.gpu_type,) if rep.gpu_type else (),
                priority=PRIORITIES[rep.priority], preemptible=rep.preemptible,
                submit_time=rep.created_at, cpu_milli=rep.cpu_milli,
                memory_mib=rep.memory_mib)  # fmt: skip


# What the scheduler reads of a job (then its placement, start and reason).
_JOB_COLUMNS = (Job.id, Job.tenant_id, Job.gpus, Job.gpu_milli, Job.gpu_type, Job.priority,
                Job.preemptible, Job.submitted_at, Job.cpu_milli, Job.memory_mib,
                Job.time_limit, Job.planned_seconds, Job.avoid_nodes)  # fmt: skip

# Misses read by id, this many to a query; more than a quarter of the queue missing
# (a burst of submissions, the first pass) reads the whole queue instead.
_IDS_PER_READ = 500


class PendingRows:
    """The pending jobs' rows, kept between passes: each pass reads only the id, attempt
    count and reason of every pending job, and whole rows only for the jobs it has not
    read at that attempt count.

    Sound because what the scheduler reads of a job is written at submission and changes
    only after a run ends (`avoid_nodes`, a straggler's node), and every run begins by
    counting an attempt: a row read at the same attempt count is the row in the store.
    At 10,000 pending jobs on SQLite, the whole rows took 41 ms to read, their ids 5 ms.
    `read` also names the jobs whose rows it read: the ones `LiveCluster` must look at.
    """

    def __init__(self) -> None:
        # job id -> (attempts, columns, scheduler id)
        self._rows: dict[int, tuple[int, tuple, str]] = {}

    def read(self, conn) -> tuple[list[tuple[tuple, str, str | None]], set[str]]:
        """Every pending job, by id: (its `_JOB_COLUMNS`, its scheduler id, its reason);
        and the scheduler ids of those whose rows were read by this call."""
        pending = JobState.PENDING
        heads = conn.execute(
            select(Job.id, Job.attempts, Job.reason).where(Job.state == pending).order_by(Job.id)
        ).all()
        known = self._rows
        missing = [jid for jid, attempts, _ in heads if known.get(jid, (None,))[0] != attempts]
        fresh: dict[int, tuple[int, tuple, str]] = {}
        if len(missing) * 4 > len(heads):
            queries = [select(Job.attempts, *_JOB_COLUMNS).where(Job.state == pending)]
        else:
            queries = [
                select(Job.attempts, *_JOB_COLUMNS).where(
                    Job.id.in_(missing[i : i + _IDS_PER_READ])
                )
                for i in range(0, len(missing), _IDS_PER_READ)
            ]
        for query in queries:
            for attempts, *columns in conn.execute(query):
                jid = columns[0]
                fresh[jid] = (attempts, tuple(columns), str(WorkloadRef.job(jid)))
        rows, kept = [], {}
        for jid, attempts, reason in heads:
            entry = fresh.get(jid) or known.get(jid)
            if entry is None or entry[0] != attempts:  # started and requeued meanwhile:
                continue  # not pending at this attempt count; the next pass reads it
            kept[jid] = entry
            rows.append((entry[1], entry[2], reason))
        self._rows = kept
        return rows, {entry[2] for entry in fresh.values()}


def _hold_over_budget(session: Session, snap: Snapshot, now: float) -> None:
    """Keep the pending jobs and replicas an exhausted budget covers out of the scheduler
    (each with its reason), list the running jobs of budgets that stop them, and the
    threshold crossings to audit."""
    evaluated = budgets.evaluate(session, now)
    snap.crossings = budgets.crossings(evaluated)
    spent = [e for e in evaluated if e.status.state == "exhausted"]
    if not spent:
        return
    conn = session.connection()
    tenants = {e.budget.tenant_id for e in spent}
    jobs = conn.execute(
        select(Job.id, Job.state, Job.tenant_id, User.name, Job.labels)
        .join(User, Job.user_id == User.id)
        .where(Job.state.in_((JobState.PENDING, JobState.RUNNING)), Job.tenant_id.in_(tenants))
    ).all()
    replicas = conn.execute(
        select(Replica.id, Deployment.tenant_id, User.name, Deployment.labels)
        .join(Deployment, Replica.deployment_id == Deployment.id)
        .join(User, Deployment.user_id == User.id)
        .where(Replica.state == ReplicaState.PENDING, Deployment.tenant_id.in_(tenants))
    ).all()
    for jid, state, tid, user, labels in jobs:
        budget = next((e for e in spent if budgets.covers(e.budget, tid, user, labels or {})), None)
        if budget is None:
            continue
        if state == JobState.PENDING:
            snap.held[str(WorkloadRef.job(jid))] = f"{budgets.EXHAUSTED}: {budget.describe()}"
        elif budget.budget.on_exhausted == "stop":
            why = f"{budgets.EXHAUSTED}: {budget.describe()}; stopped (on_exhausted: stop)"
            snap.over_budget[jid] = why
    for rid, tid, user, labels in replicas:
        budget = next((e for e in spent if budgets.covers(e.budget, tid, user, labels or {})), None)
        if budget is not None:
            snap.held[str(WorkloadRef.replica(rid))] = f"{budgets.EXHAUSTED}: {budget.describe()}"


def _run_time_history(session: Session) -> dict[int, float]:
    """Tenant id -> mean run time (seconds) of its jobs that succeeded: the estimate of a
    job without a time limit. One aggregate over the succeeded jobs (state is indexed)."""
    mean = func.avg(Job.finished_at - Job.started_at)
    rows = session.execute(
        select(Job.tenant_id, mean)
        .where(Job.state == JobState.SUCCEEDED, Job.started_at.is_not(None))
        .group_by(Job.tenant_id)
    ).all()
    return {tid: float(mean) for tid, mean in rows if mean is not None}


def _tenant_rows(session: Session) -> tuple[tuple, ...]:
    """(name, weight, cohort, GPU type, quota) of each tenant's quota."""
    rows = session.execute(
        select(Tenant.name, Tenant.weight, Tenant.cohort, Quota.gpu_type, Quota.gpus)
        .join(Quota, Quota.tenant_id == Tenant.id)
        .order_by(Quota.id)
    ).all()
    return tuple(tuple(r) for r in rows)


def _add_tenants(state: ClusterState, rows: tuple[tuple, ...]) -> None:
    """Tenants with quotas are capped at them, except that a tenant in a cohort may
    borrow the cohort's idle quota (for preemptible jobs, which the lenders' reclaim may
    stop); tenants without quotas are unlimited."""
    quotas: dict[str, dict[str, float]] = {}
    traits: dict[str, tuple[float, str | None]] = {}
    for name, weight, cohort, gpu_type, gpus in rows:
        quotas.setdefault(name, {})[gpu_type] = gpus
        traits[name] = (weight, cohort)
    for name, quota in quotas.items():
        weight, cohort = traits[name]
        state.add_tenant(
            STenant(name, quota=quota, weight=weight, cohort=cohort or f"tenant:{name}",
                    borrow=cohort is not None)  # a name no cohort can have: it lends nothing
        )  # fmt: skip
