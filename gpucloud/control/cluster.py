"""The reconciler's view of the store as the scheduler core's `ClusterState`.

Scheduler job ids are workload references (`job-N`, `replica-N`). A cordoned or draining
node keeps its running work and is cordoned in the core too, so nothing new is placed on
it; a node that is down holds nothing the core could hand out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sqlalchemy import func, null, select
from sqlalchemy.orm import Session

from gpucloud.control.executors.base import WorkloadRef
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


@dataclass
class Snapshot:
    state: ClusterState
    nodes: dict[str, int] = field(default_factory=dict)  # name -> node id
    gpu_types: dict[str, str] = field(default_factory=dict)  # name -> its GPU type
    workloads: int = 0  # jobs and replicas running or pending
    pending_reasons: dict[int, str | None] = field(default_factory=dict)  # job id -> reason
    no_pool: set[str] = field(default_factory=set)  # pending, but no node of its type is up
    held: dict[str, str] = field(default_factory=dict)  # pending, kept out: ref -> reason
    over_budget: dict[int, str] = field(default_factory=dict)  # running jobs a budget stops
    crossings: list[budgets.Crossing] = field(default_factory=list)  # not audited yet


def load(session: Session, rows: PendingRows | None = None) -> Snapshot:
    """Build the cluster state: nodes, tenant quotas, running and pending work.

    Rows are read as plain tuples through the session's connection: through the ORM,
    even a select of columns goes through its loading machinery, a third of the read at
    10,000 pending jobs. `rows`, kept by the caller between calls, saves reading again
    the pending jobs it has read before, and building their scheduler jobs again.
    """
    state = ClusterState()
    snap = Snapshot(state)
    conn = session.connection()
    nodes = conn.execute(
        select(Node.id, Node.name, Node.gpu_type, Node.gpus, Node.link_domain, Node.cpu_milli,
               Node.memory_mib, Node.state).where(Node.state != NodeState.DOWN)
    ).all()  # fmt: skip
    for n in nodes:
        state.add_node(SNode(n.name, n.gpu_type, n.gpus, domain_size=n.link_domain,
                             cpu_milli=n.cpu_milli, memory_mib=n.memory_mib))  # fmt: skip
        snap.nodes[n.name] = n.id
        snap.gpu_types[n.name] = n.gpu_type
    _add_tenants(session, state)
    tenant_names = dict(conn.execute(select(Tenant.id, Tenant.name)).all())
    _hold_over_budget(session, snap, time.time())

    # Running jobs with their devices, pending ones without: decoding 10,000 empty JSON
    # lists was half of a pass at that queue length.
    running = conn.execute(
        select(*_JOB_COLUMNS, Job.placement, Job.started_at, null())
        .where(Job.state == JobState.RUNNING)
        .order_by(Job.id)
    ).all()
    pending = (rows or PendingRows()).read(conn)
    snap.pending_reasons = {row[0]: row[-1] for row in pending}
    history = _run_time_history(session)
    snap.workloads = len(running) + len(pending)
    kept = rows.jobs if rows is not None else {}
    for rows_of, is_running in ((running, True), (pending, False)):
        for row in rows_of:
            jid, tid, *_, limit, planned, _avoid, placement, started, _reason = row
            # the scheduler's estimate (what backfill and SJF plan around): its time
            # limit, which is enforced, else the planner's run time for a train job, else
            # how long its tenant's jobs have run
            estimate = limit or planned or history.get(tid)
            sjob = None if is_running else kept.get(jid)
            if sjob is not None and sjob.tenant == tenant_names[tid]:
                sjob.reset()  # read at this attempt count: only the estimate may differ
                sjob.estimate = estimate
            else:
                sjob = _job(row, tenant_names[tid], estimate)
                if not is_running:
                    kept[jid] = sjob
            if is_running or sjob.id not in snap.held:
                _add(snap, sjob, is_running, placement, started)

    reps = conn.execute(
        select(
            Replica.id,
            Replica.state,
            Replica.placement,
            Replica.started_at,
            Replica.created_at,
            Deployment.tenant_id,
            Deployment.gpus_per_replica,
            Deployment.gpu_milli,
            Deployment.gpu_type,
            Deployment.priority,
            Deployment.preemptible,
            Deployment.cpu_milli,
            Deployment.memory_mib,
        )
        .join(Deployment, Replica.deployment_id == Deployment.id)
        .where(Replica.state.in_((ReplicaState.PENDING, *REPLICA_HOLDS_GPUS)))
        .order_by(Replica.id)
    ).all()
    snap.workloads += len(reps)
    for rid, st, placement, started, created, tid, gpus, milli, gtype, prio, pre, cpu, mem in reps:
        sjob = SJob(
            str(WorkloadRef.replica(rid)),
            tenant_names[tid],
            gpus,
            gpu_milli=milli,
            gpu_types=(gtype,) if gtype else (),
            priority=PRIORITIES[prio],
            preemptible=pre,
            submit_time=created,
            cpu_milli=cpu,
            memory_mib=mem,
        )
        if st in REPLICA_HOLDS_GPUS or sjob.id not in snap.held:
            _add(snap, sjob, st in REPLICA_HOLDS_GPUS, placement, started)

    for n in nodes:
        if n.state in (NodeState.CORDONED, NodeState.DRAINING):
            state.cordon(n.name)
    return snap


def _job(row: tuple, tenant: str, estimate: float | None) -> SJob:
    """The scheduler's job for a row of `_JOB_COLUMNS`."""
    (jid, _, gpus, milli, gtype, prio, pre, at, cpu, mem, _, _, avoid) = row[:13]
    return SJob(str(WorkloadRef.job(jid)), tenant, gpus, gpu_milli=milli,
                gpu_types=(gtype,) if gtype else (), priority=PRIORITIES[prio],
                preemptible=pre, submit_time=at, cpu_milli=cpu, memory_mib=mem,
                estimate=estimate, avoid_nodes=frozenset(avoid or ()))  # fmt: skip


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
    """

    def __init__(self) -> None:
        self._rows: dict[int, tuple[int, tuple]] = {}  # job id -> (attempts, columns)
        # job id -> the scheduler's job built from its row, reset and reused by each
        # pass's new ClusterState (`load`); dropped when its row is read again
        self.jobs: dict[int, SJob] = {}

    def read(self, conn) -> list[tuple]:
        """Every pending job, by id: its `_JOB_COLUMNS`, no placement nor start, its reason."""
        pending = JobState.PENDING
        heads = conn.execute(
            select(Job.id, Job.attempts, Job.reason).where(Job.state == pending).order_by(Job.id)
        ).all()
        known = self._rows
        missing = [jid for jid, attempts, _ in heads if known.get(jid, (None,))[0] != attempts]
        fresh: dict[int, tuple[int, tuple]] = {}
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
                fresh[columns[0]] = (attempts, tuple(columns))
        rows, kept = [], {}
        for jid, attempts, reason in heads:
            entry = fresh.get(jid) or known.get(jid)
            if entry is None or entry[0] != attempts:  # started and requeued meanwhile:
                continue  # not pending at this attempt count; the next pass reads it
            kept[jid] = entry
            rows.append((*entry[1], None, None, reason))
        self._rows = kept
        self.jobs = {jid: j for jid, j in self.jobs.items() if jid in kept and jid not in fresh}
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


def _add_tenants(session: Session, state: ClusterState) -> None:
    """Tenants with quotas are capped at them, except that a tenant in a cohort may
    borrow the cohort's idle quota (for preemptible jobs, which the lenders' reclaim may
    stop); tenants without quotas are unlimited."""
    rows = session.execute(
        select(Tenant.name, Tenant.weight, Tenant.cohort, Quota.gpu_type, Quota.gpus).join(
            Quota, Quota.tenant_id == Tenant.id
        )
    ).all()
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


def _add(
    snap: Snapshot, sjob: SJob, running: bool, placement: list[dict] | None, started: float | None
) -> None:
    state = snap.state
    if running and not (placement and all(p["node"] in snap.gpu_types for p in placement)):
        return  # on a node that is down: it holds no GPUs the scheduler can hand out
    try:
        state.submit(sjob)
    except CapacityError:
        snap.no_pool.add(sjob.id)  # no pool of its type now (a node went down): it waits
        return
    if running:
        assert placement and started is not None
        parts = tuple((p["node"], tuple(p["devices"])) for p in placement)
        alloc = Allocation(snap.gpu_types[parts[0][0]], parts, sjob.gpu_milli)
        state.start(sjob, alloc, started)
