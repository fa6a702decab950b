"""The reconciler loop: observe the workloads, load state, ask the scheduler, apply.

    reconcile = observe (exits, cancels, probes, backoffs) -> load -> decide -> apply

The reconciler is given its store and its executor (gpucloud.control.executors: this
machine, Ray or Slurm) and never asks which executor it has. Each pass first takes the
executor's node inventory into the store: a node reported unhealthy or not reported for
`node_timeout` is DOWN, and its workloads are failed over (a job requeued without using a
retry, a replica replaced elsewhere); a draining node's replicas are replaced elsewhere.

Every state change commits in its own short transaction; executor calls (start, poll,
stop) happen with no transaction open, and replica probes in the prober's threads. A job
is marked RUNNING (its GPUs leased) before its workload starts, so a crash in between
leaves a RUNNING job without a handle, which the next pass finds and requeues; never two
copies. A workload that cannot start, or exits non-zero, has failed an attempt: a job is
retried up to its max_retries, a replica restarted, both after the same exponential
backoff. One the platform lost (its node died, its process vanished) is requeued without
using a retry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from sqlalchemy import select, update

from gpucloud.control import cluster, straggling, warm_pool, workloads
from gpucloud.control.config import Settings
from gpucloud.control.db import Store
from gpucloud.control.executors.base import (
    Executor,
    Exit,
    Handle,
    StartError,
    WorkloadKind,
    WorkloadRef,
    describe_exit,
)
from gpucloud.control.lifecycle import REPLICA_HOLDS_GPUS, JobState, NodeState, ReplicaState
from gpucloud.control.models import (
    Deployment,
    DeploymentVersion,
    Job,
    Node,
    Replica,
    Tenant,
    UsageRecord,
)
from gpucloud.control.prober import Prober, Target
from gpucloud.control.services import budgets, versions
from gpucloud.control.services import deployments as deployment_service
from gpucloud.control.services import nodes as node_service
from gpucloud.control.services.jobs import transition
from gpucloud.durations import format_duration
from gpucloud.errors import UserError
from gpucloud.scheduler import Allocation, Cause, Decisions, Policy, Scheduler, Wait, get_policy

log = logging.getLogger(__name__)

# With nothing running, queued or waiting out a backoff, only an API call can give the loop
# work, and every such call wakes it: passes then come at most this often (the heartbeat).
IDLE_INTERVAL = 1.0
_NO_POOL = "waiting for a node of its GPU type to come up"
_IDS_PER_UPDATE = 500  # job ids in one UPDATE's IN list (SQLite allows 32,766 parameters)
_PREEMPTED = "preempted by a higher-priority job"
_MODELS: dict[WorkloadKind, type[Job] | type[Replica]] = {
    WorkloadKind.JOB: Job,
    WorkloadKind.REPLICA: Replica,
}


def live_policy(settings: Settings) -> Policy:
    """The policy the control plane schedules with: the configured one, with quotas,
    reclaim and the configured minimum run time."""
    return get_policy(settings.policy).with_(quotas=True, reclaim=True, min_run=settings.min_run)


class Reconciler:
    def __init__(self, store: Store, settings: Settings, executor: Executor):
        self.store = store
        self.settings = settings
        self.executor = executor
        self.scheduler = Scheduler(live_policy(settings), explain=True)
        self.metrics = None  # set by the app: observes each pass's duration
        self.autoscaler = None  # set by the app: resizes autoscaled deployments each pass
        self.reclaimer = None  # set by the app: idle deployments and interactive jobs
        self.auto_rollback = None  # set by the app: rolls back canaries that do worse
        # Whether the gateway may still send replica `rid`, out of its routes since the
        # given time, a request (set by the app: the gateway's; with none, nothing can).
        self.drained: Callable[[int, float], bool] = lambda rid, since: True
        self.timings: dict[str, float] = {}
        self.idle = False  # the last pass found no work in flight
        self._waiting = False  # a job or replica waits out its backoff
        self.prober = Prober(settings.probe_interval, settings.probe_failures)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported: tuple = ()  # the inventory last written to the store, and when
        self._reported_at = 0.0
        self._cluster = cluster.LiveCluster()  # the scheduler's state, kept between passes

    # --- the loop -------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="reconciler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.prober.close()
        self.executor.close()

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            started = time.perf_counter()
            try:
                self.reconcile()
            except Exception:  # one bad pass must not stop the control plane
                log.exception("reconciler pass failed")
            # A burst of submissions wakes the loop many times: batch them into one pass,
            # and rest at least three times as long as the pass took, so that with a long
            # queue the scheduler never takes more than a quarter of the API's process.
            took = time.perf_counter() - started
            interval = self.settings.reconcile_interval
            self._stop.wait(max(min(0.2, interval), 3 * took))
            self._wake.wait(max(interval, IDLE_INTERVAL) if self.idle else interval)

    def reconcile(self) -> Decisions:
        """One pass. Returns the scheduler's decisions (already applied)."""
        t0 = time.perf_counter()
        self._observe()
        t1 = time.perf_counter()
        with self.store.reading() as s:
            snap = self._cluster.load(s, time.time())
        t2 = time.perf_counter()
        decisions = self.scheduler.schedule(snap.state, time.time())
        t3 = time.perf_counter()
        self._apply(decisions, snap)
        self._budgets(snap)
        if self.reclaimer is not None:  # idle workloads: warned, then reclaimed
            self.reclaimer.apply(self.store, time.time())
        if self.auto_rollback is not None:
            self.auto_rollback.apply(self.store, time.time())
        if self.autoscaler is not None:  # last: its resizes are the next pass's to place
            with self.store.transaction() as s:
                self.autoscaler.apply(s, time.monotonic())
        self.idle = not (snap.workloads or self._waiting)
        t4 = time.perf_counter()
        self.timings = {"observe": t1 - t0, "load": t2 - t1, "decide": t3 - t2, "apply": t4 - t3}
        if self.metrics is not None:
            self.metrics.scheduling_pass.observe(t4 - t0)
            for phase, seconds in self.timings.items():
                self.metrics.scheduling_phase.labels(phase).inc(seconds)
        return decisions

    def _budgets(self, snap: cluster.Snapshot) -> None:
        """Stop the running jobs of spent budgets that say so (through the cancel path, in
        the next pass), say why held replicas wait, audit new threshold crossings."""
        held = {
            ref.id: why
            for sid, why in snap.held.items()
            if (ref := WorkloadRef.parse(sid)).kind == WorkloadKind.REPLICA
        }
        if snap.over_budget or held or snap.crossings:
            with self.store.transaction() as s:
                budgets.stop(s, snap.over_budget)
                budgets.explain_held_replicas(s, held)
                budgets.audit_crossings(s, snap.crossings)

    # --- observe --------------------------------------------------------------------
    def _observe(self) -> None:
        self._apply_probes()  # first: a replica found dead is stopped in this very pass
        now = time.time()
        self._take_inventory(now)
        with self.store.transaction() as s:
            self._waiting = False
            for job in s.scalars(select(Job).where(Job.state == JobState.RETRYING)):
                if job.not_before <= now:
                    transition(s, job, JobState.PENDING, "backoff over", now)
                else:
                    self._waiting = True
            for r in s.scalars(select(Replica).where(Replica.state == ReplicaState.RESTARTING)):
                if r.not_before <= now:
                    deployment_service.set_replica_state(r, ReplicaState.PENDING)
                else:
                    self._waiting = True
            away = {
                name: (state, reason)
                for name, state, reason in s.execute(
                    select(Node.name, Node.state, Node.reason).where(
                        Node.state.in_((NodeState.DOWN, NodeState.DRAINING))
                    )
                )
            }
            running = s.execute(
                select(
                    Job.id,
                    Job.handle,
                    Job.placement,
                    Job.cancel_requested,
                    Job.started_at,
                    Job.time_limit,
                    Job.stop_reason,
                ).where(Job.state == JobState.RUNNING)
            ).all()
            live = s.execute(
                select(
                    Replica.id,
                    Replica.handle,
                    Replica.placement,
                    Replica.state,
                    Replica.url,
                    Replica.started_at,
                    Replica.index,
                    Deployment.replicas,
                    Deployment.warm_pool,
                    Deployment.reclaimed_replicas,
                    Deployment.state,
                    DeploymentVersion.state,
                    DeploymentVersion.percent,
                    DeploymentVersion.ended_at,
                )
                .join(Deployment, Replica.deployment_id == Deployment.id)
                .join(DeploymentVersion, Replica.version_id == DeploymentVersion.id)
                .where(Replica.state.in_(REPLICA_HOLDS_GPUS))
            ).all()
        for job_id, token, placement, cancel, started, limit, stop_reason in running:
            handle = _handle(WorkloadRef.job(job_id), token)
            down = _down_node(placement, away, NodeState.DOWN)
            if cancel:  # SIGTERM first: it may save a checkpoint
                self._stop_workload(handle)
                why = stop_reason or "cancelled"
                self._job_ended(job_id, Exit(None, why), JobState.CANCELLED)
            elif limit is not None and now - started >= limit:
                # SIGTERM first (a training run saves a checkpoint), SIGKILL after the grace
                # period; not retried: the next run would meet the same limit
                stopped = self._stop_workload(handle)
                why = f"time limit {format_duration(limit)} reached"
                code = stopped.code if stopped is not None else None
                self._job_ended(job_id, Exit(code, why), JobState.FAILED)
            elif handle is None:
                self._job_ended(job_id, Exit(None, "process lost", lost=True))
            elif down is not None:
                self._stop_workload(handle)
                why = f"node {down} is down ({away[down][1] or 'no reason given'})"
                self._job_ended(job_id, Exit(None, why, lost=True))
            elif (ended := self.executor.poll(handle)) is not None:
                self._job_ended(job_id, ended)
        self._observe_replicas(live, away, now)
        self._finish_deletions()

    def _take_inventory(self, now: float) -> None:
        """Write the executor's nodes to the store when they changed, and at least every
        third of the node timeout (their heartbeat)."""
        inventory = tuple(self.executor.inventory())
        if inventory == self._reported and now - self._reported_at < self._beat:
            return
        with self.store.transaction() as s:
            for name in node_service.sync(s, list(inventory), now, self.settings.node_timeout):
                log.warning("node %s is down", name)
        self._reported, self._reported_at = inventory, now

    @property
    def _beat(self) -> float:
        return self.settings.node_timeout / 3

    def _observe_replicas(self, live: list, away: dict[str, tuple], now: float) -> None:
        """Stop the replicas no longer wanted (those of a version that ended once the gateway
        has drained them), replace the FAILED and exited ones and those on a node that is
        down or draining, and hand the others to the prober."""
        probes = []
        for (rid, token, placement, st, url, started_at, index, replicas, pool, reclaimed,
             dep_state, version, percent, ended_at) in live:  # fmt: skip
            handle = _handle(WorkloadRef.replica(rid), token)
            moved = _down_node(placement, away, NodeState.DOWN, NodeState.DRAINING)
            routed = versions.wanted(replicas, version, percent)
            kept = warm_pool.kept(routed, version, warm_pool.size(pool, reclaimed))
            if ended_at is not None and self._draining(rid, ended_at, now):
                continue  # its version ended: left alone until its last requests are done
            if dep_state != deployment_service.ACTIVE or index >= kept:
                self._stop_workload(handle)
                self._replica_ended(rid, ReplicaState.STOPPED, None)
            elif st == ReplicaState.FAILED:  # stopped, then replaced
                ended = self._stop_workload(handle)
                self._replica_ended(rid, ReplicaState.RESTARTING, ended.code if ended else None)
            elif handle is None:
                self._replica_ended(rid, ReplicaState.RESTARTING, None, "process lost")
            elif moved is not None:
                self._stop_workload(handle)
                why = f"node {moved} is {away[moved][0]}: replaced elsewhere"
                self._replica_ended(rid, ReplicaState.RESTARTING, None, why, counted=False)
            elif (ended := self.executor.poll(handle)) is not None:
                why = ended.reason or f"process exited: {describe_exit(ended.code)}"
                self._replica_ended(rid, ReplicaState.RESTARTING, ended.code, why)
            elif st == ReplicaState.STARTING and now - started_at > self.settings.ready_timeout:
                self._replica_failed(
                    rid, started_at, f"not ready within {self.settings.ready_timeout:g} s"
                )
            else:
                ready = st in (ReplicaState.READY, ReplicaState.WARM)
                probes.append(Target(rid, started_at, url, ready=ready))
        self.prober.submit(probes, time.monotonic())

    def _draining(self, rid: int, ended_at: float, now: float) -> bool:
        """Whether replica `rid`, of a version that ended at `ended_at`, is left to finish
        its requests: until the gateway has none in flight on it, or for `drain_limit`
        seconds at most (then it is stopped even with a stream open: SIGTERM, SIGKILL after
        the grace period)."""
        return now - ended_at < self.settings.drain_limit and not self.drained(rid, ended_at)

    def _apply_probes(self) -> None:
        """Starting replicas that answered /ready become READY (WARM in the warm pool); ready
        ones found dead FAILED."""
        ready, dead = self.prober.collect()
        if ready:
            with self.store.transaction() as s:
                for t in ready:
                    r = s.get(Replica, t.replica)
                    if r.state == ReplicaState.STARTING and r.started_at == t.started_at:
                        deployment_service.set_replica_state(r, warm_pool.ready_state(s, r))
                        r.ready_at = time.time()
        for t, why in dead.items():
            self._replica_failed(t.replica, t.started_at, why)

    def _replica_failed(self, rid: int, started_at: float, reason: str) -> None:
        """Mark the run of replica `rid` begun at `started_at` FAILED: the gateway routes it
        nothing from now on, and the next observation stops its process and replaces it."""
        with self.store.transaction() as s:
            r = s.get(Replica, rid)
            if r.started_at != started_at or r.state not in REPLICA_HOLDS_GPUS:
                return  # a verdict on a run that has ended since
            if r.state != ReplicaState.FAILED:
                deployment_service.set_replica_state(r, ReplicaState.FAILED)
                r.reason = reason
                log.warning("replica %s failed: %s", rid, reason)

    def _finish_deletions(self) -> None:
        with self.store.transaction() as s:
            for dep in s.scalars(
                select(Deployment).where(Deployment.state == deployment_service.DELETING)
            ):
                pending = [
                    r
                    for r in deployment_service.live_replicas(s, dep)
                    if r.state not in REPLICA_HOLDS_GPUS
                ]
                for r in pending:
                    deployment_service.set_replica_state(r, ReplicaState.STOPPED)
                if not deployment_service.live_replicas(s, dep):
                    dep.state = deployment_service.DELETED

    # --- apply ----------------------------------------------------------------------
    def _apply(self, decisions: Decisions, snap: cluster.Snapshot) -> None:
        for victim in decisions.preemptions:  # stopped first: their GPUs go to the starts
            self._preempt(WorkloadRef.parse(victim.id), _preempted(decisions, victim.id))
        for sjob, alloc in decisions.starts:
            self._start(WorkloadRef.parse(sjob.id), alloc, snap)
        self._explain(decisions, snap)

    def _explain(self, decisions: Decisions, snap: cluster.Snapshot) -> None:
        """Each pending job's reason says why it waits; only changed ones are written, and
        only while the job is still PENDING (a cancel in between keeps its own reason).

        The jobs waiting share a handful of reasons: one UPDATE per reason (per
        `_IDS_PER_UPDATE` jobs), not one per job. After a burst of submissions the pass
        explains thousands of new jobs, and on PostgreSQL each statement is a round trip
        for which this thread waits for the GIL behind the API's: one UPDATE per job made
        that pass take seconds (benchmarks/control_plane.py, 10,000 jobs)."""
        started = {sjob.id for sjob, _ in decisions.starts}
        changed: dict[str, list[int]] = {}  # reason -> the jobs it is new for
        for row, sid, reason in snap.pending:
            jid = row[0]
            if sid in started:
                continue
            why = snap.held.get(sid) or (
                _NO_POOL if sid in snap.no_pool else decisions.waiting.get(sid, Wait.ORDER)
            )
            if why != reason:
                changed.setdefault(str(why), []).append(jid)
        if changed:
            with self.store.transaction() as s:
                conn = s.connection()
                for why, ids in changed.items():
                    for at in range(0, len(ids), _IDS_PER_UPDATE):
                        conn.execute(
                            update(Job)
                            .where(
                                Job.id.in_(ids[at : at + _IDS_PER_UPDATE]),
                                Job.state == JobState.PENDING,
                            )
                            .values(reason=why)
                        )

    def _preempt(self, ref: WorkloadRef, why: str = _PREEMPTED) -> None:
        """Stop a running workload and put it back in the queue (its GPUs go to another)."""
        model = _MODELS[ref.kind]
        with self.store.reading() as s:
            handle = _handle(ref, s.get(model, ref.id).handle)
        self._stop_workload(handle)
        now = time.time()
        with self.store.transaction() as s:
            row = s.get(model, ref.id)
            _close_usage(s, now, ref)
            if isinstance(row, Job):
                transition(s, row, JobState.PREEMPTED, why, now)
                transition(s, row, JobState.PENDING, "requeued after preemption", now)
                row.preemptions += 1
            else:
                deployment_service.set_replica_state(row, ReplicaState.RESTARTING)
                deployment_service.set_replica_state(row, ReplicaState.PENDING)
            _clear_placement(row)

    def _start(self, ref: WorkloadRef, alloc: Allocation, snap: cluster.Snapshot) -> None:
        """Lease the workload its placement (RUNNING / STARTING, usage opened) in one
        transaction, then have the executor start it; one that cannot start has failed an
        attempt, like one that exits non-zero."""
        now = time.time()
        with self.store.transaction() as s:
            placement = [(s.get(Node, snap.nodes[name]), list(gpus)) for name, gpus in alloc.parts]
            lease = self._lease_job if ref.kind == WorkloadKind.JOB else self._lease_replica
            leased = lease(s, ref.id, placement, now)
            if leased is None:
                return  # cancelled or deleted since the state was loaded
            tenant, build = leased
            s.add(
                UsageRecord(
                    tenant_id=tenant.id,
                    job_id=ref.id if ref.kind == WorkloadKind.JOB else None,
                    replica_id=ref.id if ref.kind == WorkloadKind.REPLICA else None,
                    gpu_type=alloc.gpu_type,
                    gpus=alloc.gpus,
                    started_at=now,
                    node=placement[0][0].name,  # its pool's price
                )
            )
        try:
            handle = self.executor.start(build(self.settings, placement=placement))
        except (StartError, OSError, UserError) as e:  # an attempt, like a non-zero exit
            self._ended(ref, Exit(None, f"could not start: {e}"))
            return
        with self.store.transaction() as s:
            s.get(_MODELS[ref.kind], ref.id).handle = handle.token

    def _lease_job(self, s, job_id: int, placement: workloads.Placement, now: float):
        job = s.get(Job, job_id)
        if job.state != JobState.PENDING:
            return None
        where = ", ".join(f"{node.name} GPUs {devices}" for node, devices in placement)
        transition(s, job, JobState.RUNNING, f"on {where}", now)
        _place(job, placement)
        job.started_at = now
        job.attempts += 1
        job.exit_code = None
        job.log_path = str(self.settings.log_path(WorkloadRef.job(job.id)))
        tenant = s.get(Tenant, job.tenant_id)
        return tenant, partial(workloads.job_launch, job=job, tenant=tenant)

    def _lease_replica(self, s, rid: int, placement: workloads.Placement, now: float):
        r = s.get(Replica, rid)
        dep = s.get(Deployment, r.deployment_id)
        if r.state != ReplicaState.PENDING or dep.state != deployment_service.ACTIVE:
            return None
        version = s.get(DeploymentVersion, r.version_id)
        port = workloads.free_port()
        deployment_service.set_replica_state(r, ReplicaState.STARTING)
        if r.reason and r.reason.startswith(budgets.EXHAUSTED):
            r.reason = None  # why it waited, not why it last failed: over once it starts
        _place(r, placement)
        r.port, r.url = port, workloads.replica_url(placement[0][0].address, port)
        r.started_at = now
        r.log_path = str(self.settings.log_path(WorkloadRef.replica(r.id)))
        tenant = s.get(Tenant, dep.tenant_id)
        return tenant, partial(
            workloads.replica_launch, dep=dep, version=version, tenant=tenant, replica=r, port=port
        )

    # --- endings --------------------------------------------------------------------
    def _ended(self, ref: WorkloadRef, ended: Exit) -> None:
        if ref.kind == WorkloadKind.JOB:
            self._job_ended(ref.id, ended)
        else:
            self._replica_ended(ref.id, ReplicaState.RESTARTING, ended.code, ended.reason)

    def _job_ended(self, job_id: int, ended: Exit, to: JobState | None = None) -> None:
        """Record how a running job ended; with `to` None, decide from how it exited."""
        now = time.time()
        with self.store.transaction() as s:
            job = s.get(Job, job_id)
            if job.state != JobState.RUNNING:
                return
            _close_usage(s, now, WorkloadRef.job(job.id))
            job.exit_code = ended.code
            reason = ended.reason
            if to is None:
                to, reason = self._after_exit(job, ended, now, self._straggling_node(s, job, ended))
            transition(s, job, to, reason, now)
            self._waiting |= to == JobState.RETRYING
            _clear_placement(job)

    def _straggling_node(self, s, job: Job, ended: Exit) -> tuple[str, str] | None:
        """A training run's straggling node (exit 5), to restart the job without it."""
        if job.train_config is None or ended.code != straggling.STRAGGLING_NODE_EXIT:
            return None
        run_dir = workloads.job_run_dir(self.settings, job, s.get(Tenant, job.tenant_id).name)
        return straggling.straggling_node(run_dir, [part["node"] for part in job.placement])

    def _after_exit(
        self, job: Job, ended: Exit, now: float, straggler: tuple[str, str] | None = None
    ) -> tuple[JobState, str]:
        if ended.code == 0 and not ended.lost:
            return JobState.SUCCEEDED, "exit code 0"
        what = ended.reason or describe_exit(ended.code, train=job.train_config is not None)
        if straggler is not None:  # the node's failure, not the job's: no retry used
            node, why = straggler
            job.avoid_nodes = sorted({*(job.avoid_nodes or ()), node})
            job.requeues += 1
            return JobState.RETRYING, f"{what}; {why}; requeued without node {node}"
        if ended.lost:  # the platform's failure, not the job's: not one of its retries
            job.requeues += 1
            delay = self.settings.backoff(1)
            job.not_before = now + delay
            return JobState.RETRYING, f"{what}; requeued (no retry used), in {delay:g} s"
        if job.attempts - job.requeues <= job.max_retries:
            delay = self.settings.backoff(job.attempts - job.requeues)
            job.not_before = now + delay
            return JobState.RETRYING, f"{what}; retry in {delay:g} s"
        return JobState.FAILED, f"{what}; no retries left"

    def _replica_ended(
        self,
        rid: int,
        to: ReplicaState,
        code: int | None,
        reason: str | None = None,
        counted: bool = True,
    ) -> None:
        """Record how a replica's run ended. RESTARTING backs off, with `reason` (a FAILED
        replica's own reason) and the delay as the replica's reason; a `counted` one (the
        replica's failure, not its node's) adds to its restarts."""
        now = time.time()
        with self.store.transaction() as s:
            r = s.get(Replica, rid)
            if r.state not in REPLICA_HOLDS_GPUS:
                return
            _close_usage(s, now, WorkloadRef.replica(r.id))
            what = r.reason if r.state == ReplicaState.FAILED else reason
            deployment_service.set_replica_state(r, to)
            r.exit_code = code
            if to == ReplicaState.RESTARTING:
                r.restarts += counted
                delay = self.settings.backoff(r.restarts) if counted else 0.0
                r.not_before = now + delay
                r.reason = f"{what}; restart in {delay:g} s"
                self._waiting = True
                log.info("replica %s: %s", rid, r.reason)
            _clear_placement(r)

    # --- gpucloud down --stop-workloads ----------------------------------------------
    def stop_all(self, reason: str) -> tuple[list[int], list[int]]:
        """Stop every running workload and record it, with no control plane running.

        A job ends CANCELLED with `reason` (one that ended meanwhile is recorded as it
        ended); a replica goes back to PENDING, for its deployment is still wanted: the next
        control plane starts it again. The workloads get SIGTERM together and SIGKILL after
        the grace period. Returns the ids of the jobs and replicas stopped.
        """
        with self.store.reading() as s:
            jobs = s.execute(select(Job.id, Job.handle).where(Job.state == JobState.RUNNING))
            jobs = jobs.all()
            replicas = s.execute(
                select(Replica.id, Replica.handle).where(Replica.state.in_(REPLICA_HOLDS_GPUS))
            ).all()
        job_handles = {i: _handle(WorkloadRef.job(i), token) for i, token in jobs}
        ended = {i: self.executor.poll(h) for i, h in job_handles.items() if h is not None}
        handles = [h for i, h in job_handles.items() if ended.get(i) is None]
        handles += [_handle(WorkloadRef.replica(i), token) for i, token in replicas]
        with ThreadPoolExecutor(max_workers=min(32, max(1, len(handles)))) as pool:
            list(pool.map(self._stop_workload, handles))
        stopped = []
        for job_id in job_handles:
            if (exit_ := ended.get(job_id)) is not None:
                self._job_ended(job_id, exit_)
            else:
                self._job_ended(job_id, Exit(None, reason), JobState.CANCELLED)
                stopped.append(job_id)
        for rid, _ in replicas:
            self._preempt(WorkloadRef.replica(rid))  # it is gone: this records PENDING
        return stopped, [r[0] for r in replicas]

    def _stop_workload(self, handle: Handle | None) -> Exit | None:
        if handle is None:
            return None
        return self.executor.stop(handle, self.settings.grace_seconds)


def _handle(ref: WorkloadRef, token: str | None) -> Handle | None:
    return Handle(ref, token) if token else None


def _down_node(placement: list[dict], away: dict[str, tuple], *states: str) -> str | None:
    """The first node of the placement in one of `states`, if any (`away`: node name ->
    its state and reason, for the nodes down or draining)."""
    return next((p["node"] for p in placement if away.get(p["node"], ("",))[0] in states), None)


def _place(row: Job | Replica, placement: workloads.Placement) -> None:
    first, devices = placement[0]
    row.node_id, row.devices = first.id, devices
    row.placement = [{"node": node.name, "devices": gpus} for node, gpus in placement]


def _close_usage(session, now: float, ref: WorkloadRef) -> None:
    column = UsageRecord.job_id if ref.kind == WorkloadKind.JOB else UsageRecord.replica_id
    for rec in session.scalars(
        select(UsageRecord).where(UsageRecord.ended_at.is_(None), column == ref.id)
    ):
        rec.ended_at = now


def _clear_placement(row: Job | Replica) -> None:
    row.handle = None
    row.node_id = None
    row.devices = []
    row.placement = []
    if isinstance(row, Replica):
        row.port = row.url = None


def _preempted(decisions: Decisions, victim: str) -> str:
    """The reason a preempted job's events show: for whom and why it was stopped."""
    cause, by = decisions.preempted_for[victim]
    if cause is Cause.RECLAIM:
        return f"reclaimed: tenant {by.tenant} needs its lent quota back"
    if cause is Cause.GUARD:
        return f"preempted for {by.id}, which has waited its turn (the wait guard)"
    return f"{_PREEMPTED} ({by.id})"
