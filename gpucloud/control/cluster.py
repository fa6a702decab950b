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
    # pending job id -> (its scheduler id, the reason the store has for its wait)
    pending_reasons: dict[int, tuple[str, str | None]] = field(default_factory=dict)
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
        self._read: dict[str, object] = {}  # pending scheduler id -> the row its job is from
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
            self._built_from, self._read = built_from, {}
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
        runs: dict[str, tuple] = {}  # id -> (row, its job's maker, parts, milli, start)
        running = conn.execute(
            select(*_JOB_COLUMNS, Job.placement, Job.started_at)
            .where(Job.state == JobState.RUNNING)
            .order_by(Job.id)
        ).all()
        for row in running:
            _want_run(runs, snap, str(WorkloadRef.job(row[0])), row, make_job, row[3])
        pending = self._rows.read(conn)
        # id -> (row, its job's maker, whether a changed row updates the job in place)
        waits: dict[str, tuple] = {}
        for row, sid, reason in pending:
            snap.pending_reasons[row[0]] = (sid, reason)
            if sid not in snap.held:
                waits[sid] = (row, make_job, True)
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
                waits[sid] = (rep, make_replica, False)
        snap.workloads = len(running) + len(pending) + len(reps)

        try:
            self._follow(session, state, runs, waits, now, rehistoried)
        except Exception:
            self.state = None  # half brought up to date: the next pass builds it anew
            raise
        snap.no_pool = {sid for sid in waits if sid not in state.pending}
        return snap

    def _follow(self, session: Session, state: ClusterState, runs: dict, waits: dict,
                now: float, rehistoried: set[int]) -> None:  # fmt: skip
        """Bring `state`'s running and pending work to what the store has."""
        ended: list[SJob] = []
        for sid, job in list(state.running.items()):
            want = runs.get(sid)
            if want is not None and job.allocation.parts == want[1]:
                continue
            if want is not None or sid in waits:
                state.preempt(job, now)  # requeued, or moved: started again below
            else:
                ended.append(job)
        for sid, job in list(state.pending.items()):
            if sid not in waits and sid not in runs:
                self._read.pop(sid, None)
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
            self._read.pop(sid, None)
            state.start(job, Allocation(state.nodes[parts[0][0]].gpu_type, parts, milli), started)
        for sid, (row, make, in_place) in waits.items():
            job = state.jobs.get(sid)
            if job is not None and self._read.get(sid) != row:
                if in_place and job.state is SJobState.PENDING:
                    fresh = make(row)  # requeued, its row read again: a run changed it
                    state.update(job, fresh.estimate, fresh.avoid_nodes)
                else:
                    state.forget(job, now)
                    job = None
            elif job is not None and in_place and row[1] in rehistoried:
                estimate = make(row).estimate
                if estimate != job.estimate:
                    state.update(job, estimate, job.avoid_nodes)
            if job is None:
                try:
                    state.submit(make(row))
                except CapacityError:
                    continue  # no pool of its type now (a node went down): it waits
            self._read[sid] = row

    def _outgrown(self, state: ClusterState) -> bool:
        return len(state.arrived) > len(state.pending) + len(state.running) + _ARRIVALS_KEPT


# Ended jobs a kept state remembers (the virtual FIFO's record of arrivals) before it is
# built anew: a few hundred bytes each.
_ARRIVALS_KEPT = 50_000


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
    (jid, tid, gpus, milli, gtype, prio, pre, at, cpu, mem, limit, planned, avoid) = row[:13]
    # the scheduler's estimate (what backfill and SJF plan around): its time limit, which
    # is enforced, else the planner's run time for a train job, else how long its
    # tenant's jobs have run
    estimate = limit or planned or history.get(tid)
    return SJob(str(WorkloadRef.job(jid)), tenant_names[tid], gpus, gpu_milli=milli,
                gpu_types=(gtype,) if gtype else (), priority=PRIORITIES[prio],
                preemptible=pre, submit_time=at, cpu_milli=cpu, memory_mib=mem,
                estimate=estimate, avoid_nodes=frozenset(avoid or ()))  # fmt: skip


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
    A row kept is the same object from pass to pass: `LiveCluster` tells by identity
    whether it has seen it.
    """

    def __init__(self) -> None:
        # job id -> (attempts, columns, scheduler id)
        self._rows: dict[int, tuple[int, tuple, str]] = {}

    def read(self, conn) -> list[tuple[tuple, str, str | None]]:
        """Every pending job, by id: (its `_JOB_COLUMNS`, its scheduler id, its reason)."""
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
        return rows


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
