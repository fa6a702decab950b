"""The reconciler loop: observe the workloads, load state, ask the scheduler, apply.

    reconcile = observe (exits, cancels, probes, backoffs) -> load -> decide -> apply

Every state change commits in its own short transaction; process I/O (start, signal,
wait) happens with no transaction open, and replica probes in the prober's threads. A job
is marked RUNNING (its GPUs leased) before its process starts, so a crash in between leaves
a RUNNING job without a process, which the next pass finds and retries; never two processes.
A workload that cannot start, or exits non-zero, has failed an attempt: a job is retried
up to its max_retries, a replica restarted, both after the same exponential backoff.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import bindparam, select, update

from gpucloud.control import cluster, workloads
from gpucloud.control.config import Settings
from gpucloud.control.db import Store
from gpucloud.control.executors.local import (
    Exit,
    Handle,
    LocalExecutor,
    StartError,
    describe_exit,
)
from gpucloud.control.lifecycle import REPLICA_HOLDS_GPUS, JobState, ReplicaState
from gpucloud.control.models import Deployment, Job, Node, Replica, Tenant, UsageRecord
from gpucloud.control.prober import Prober, Target
from gpucloud.control.sandbox import Sandbox, scope_for
from gpucloud.control.services import deployments as deployment_service
from gpucloud.control.services.jobs import transition
from gpucloud.errors import UserError
from gpucloud.scheduler import Allocation, Decisions, Scheduler, Wait, get_policy

log = logging.getLogger(__name__)

# With nothing running, queued or waiting out a backoff, only an API call can give the loop
# work, and every such call wakes it: passes then come at most this often (the heartbeat).
IDLE_INTERVAL = 1.0
_NO_POOL = "waiting for a node of its GPU type to come up"


class Reconciler:
    def __init__(self, store: Store, settings: Settings, executor: LocalExecutor | None = None):
        self.store = store
        self.settings = settings
        self.executor = executor or LocalExecutor(Sandbox(scope_for(settings.home)))
        policy = get_policy(settings.policy).with_(quotas=True, min_run=settings.min_run)
        self.scheduler = Scheduler(policy, explain=True)
        self.metrics = None  # set by the app: observes each pass's duration
        self.autoscaler = None  # set by the app: resizes autoscaled deployments each pass
        self.timings: dict[str, float] = {}
        self.idle = False  # the last pass found no work in flight
        self._waiting = False  # a job or replica waits out its backoff
        self.prober = Prober(settings.probe_interval, settings.probe_failures)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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
        self.executor.sandbox.close()  # its scope, if no workload is left in it

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
            # and rest at least as long as the pass took, so that with a long queue the
            # scheduler never takes more than half of the API's process.
            took = time.perf_counter() - started
            interval = self.settings.reconcile_interval
            self._stop.wait(max(min(0.2, interval), took))
            self._wake.wait(max(interval, IDLE_INTERVAL) if self.idle else interval)

    def reconcile(self) -> Decisions:
        """One pass. Returns the scheduler's decisions (already applied)."""
        t0 = time.perf_counter()
        self._observe()
        t1 = time.perf_counter()
        with self.store.reading() as s:
            snap = cluster.load(s)
        t2 = time.perf_counter()
        decisions = self.scheduler.schedule(snap.state, time.time())
        t3 = time.perf_counter()
        self._apply(decisions, snap)
        if self.autoscaler is not None:  # last: its resizes are the next pass's to place
            with self.store.transaction() as s:
                self.autoscaler.apply(s, time.monotonic())
        self.idle = not (snap.workloads or self._waiting)
        t4 = time.perf_counter()
        self.timings = {"observe": t1 - t0, "load": t2 - t1, "decide": t3 - t2, "apply": t4 - t3}
        if self.metrics is not None:
            self.metrics.scheduling_pass.observe(t4 - t0)
        return decisions

    # --- observe --------------------------------------------------------------------
    def _observe(self) -> None:
        self._apply_probes()  # first: a replica found dead is stopped in this very pass
        now = time.time()
        with self.store.transaction() as s:
            s.execute(  # this machine's heartbeat: the executor that runs on it is alive
                update(Node).where(Node.name == self.settings.node_name).values(heartbeat_at=now)
            )
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
            running = s.execute(
                select(Job.id, Job.pid, Job.pid_start_time, Job.cancel_requested).where(
                    Job.state == JobState.RUNNING
                )
            ).all()
            live = s.execute(
                select(
                    Replica.id,
                    Replica.pid,
                    Replica.pid_start_time,
                    Replica.state,
                    Replica.port,
                    Replica.started_at,
                    Replica.index,
                    Deployment.replicas,
                    Deployment.state,
                )
                .join(Deployment, Replica.deployment_id == Deployment.id)
                .where(Replica.state.in_(REPLICA_HOLDS_GPUS))
            ).all()
        for job_id, pid, started, cancel in running:
            handle = self._handle(pid, started, self.settings.job_log(job_id))
            if cancel:
                self._stop_process(handle)
                self._job_ended(job_id, JobState.CANCELLED, None, "cancelled")
            elif handle is None:
                self._job_ended(job_id, None, None, "process lost", lost=True)
            elif (ended := self.executor.poll(handle)) is not None:
                lost = ended.code is None and ended.reason is None
                self._job_ended(job_id, None, ended.code, ended.reason, lost=lost)
        self._observe_replicas(live, now)
        self._finish_deletions()

    def _observe_replicas(self, live: list, now: float) -> None:
        """Stop the replicas no longer wanted, replace the FAILED and exited ones, and hand
        the others to the prober."""
        probes = []
        for rid, pid, started, st, port, started_at, index, wanted, dep_state in live:
            handle = self._handle(pid, started, self.settings.replica_log(rid))
            if dep_state != deployment_service.ACTIVE or index >= wanted:
                self._stop_process(handle)
                self._replica_ended(rid, ReplicaState.STOPPED, None)
            elif st == ReplicaState.FAILED:  # stopped, then replaced
                ended = self._stop_process(handle)
                self._replica_ended(rid, ReplicaState.RESTARTING, ended.code if ended else None)
            elif handle is None:
                self._replica_ended(rid, ReplicaState.RESTARTING, None, "process lost")
            elif (ended := self.executor.poll(handle)) is not None:
                why = ended.reason or f"process exited: {describe_exit(ended.code)}"
                self._replica_ended(rid, ReplicaState.RESTARTING, ended.code, why)
            elif st == ReplicaState.STARTING and now - started_at > self.settings.ready_timeout:
                self._replica_failed(
                    rid, started_at, f"not ready within {self.settings.ready_timeout:g} s"
                )
            else:
                probes.append(Target(rid, started_at, port, ready=st == ReplicaState.READY))
        self.prober.submit(probes, time.monotonic())

    def _apply_probes(self) -> None:
        """Starting replicas that answered /ready become READY; ready ones found dead FAILED."""
        ready, dead = self.prober.collect()
        if ready:
            with self.store.transaction() as s:
                for t in ready:
                    r = s.get(Replica, t.replica)
                    if r.state == ReplicaState.STARTING and r.started_at == t.started_at:
                        deployment_service.set_replica_state(r, ReplicaState.READY)
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
            self._preempt(victim.id)
        for sjob, alloc in decisions.starts:
            kind, _, num = sjob.id.partition("-")
            if kind == "job":
                self._start_job(int(num), alloc, snap)
            elif kind == "replica":
                self._start_replica(int(num), alloc, snap)
        self._explain(decisions, snap)

    def _explain(self, decisions: Decisions, snap: cluster.Snapshot) -> None:
        """Each pending job's reason says why it waits; only changed ones are written, and
        only while the job is still PENDING (a cancel in between keeps its own reason)."""
        started = {sjob.id for sjob, _ in decisions.starts}
        changed = []
        for jid, reason in snap.pending_reasons.items():
            sid = f"job-{jid}"
            if sid in started:
                continue
            why = _NO_POOL if sid in snap.no_pool else decisions.waiting.get(sid, Wait.ORDER)
            if why != reason:
                changed.append({"jid": jid, "why": str(why)})
        if changed:
            with self.store.transaction() as s:
                s.connection().execute(
                    update(Job)
                    .where(Job.id == bindparam("jid"), Job.state == JobState.PENDING)
                    .values(reason=bindparam("why")),
                    changed,
                )

    def _preempt(self, sid: str) -> None:
        kind, _, num = sid.partition("-")
        model = Job if kind == "job" else Replica
        with self.store.transaction() as s:
            row = s.get(model, int(num))
            log_path = (self.settings.job_log if kind == "job" else self.settings.replica_log)(
                row.id
            )
            handle = self._handle(row.pid, row.pid_start_time, log_path)
        self._stop_process(handle)
        now = time.time()
        with self.store.transaction() as s:
            row = s.get(model, int(num))
            if kind == "job":
                _close_usage(s, now, job_id=row.id)
                transition(s, row, JobState.PREEMPTED, "preempted by a higher-priority job", now)
                transition(s, row, JobState.PENDING, "requeued after preemption", now)
                row.preemptions += 1
            else:
                _close_usage(s, now, replica_id=row.id)
                deployment_service.set_replica_state(row, ReplicaState.RESTARTING)
                deployment_service.set_replica_state(row, ReplicaState.PENDING)
            _clear_process(row)

    def _start_job(self, job_id: int, alloc: Allocation, snap: cluster.Snapshot) -> None:
        ((node_name, devices),) = alloc.parts
        now = time.time()
        with self.store.transaction() as s:
            job = s.get(Job, job_id)
            if job.state != JobState.PENDING:
                return  # cancelled since the state was loaded
            node = s.get(Node, snap.nodes[node_name])
            transition(s, job, JobState.RUNNING, f"on {node_name} GPUs {list(devices)}", now)
            job.node_id, job.devices, job.started_at = node.id, list(devices), now
            job.attempts += 1
            job.exit_code = None
            job.log_path = str(self.settings.job_log(job.id))
            s.add(
                UsageRecord(
                    tenant_id=job.tenant_id,
                    job_id=job.id,
                    gpu_type=alloc.gpu_type,
                    gpus=len(devices),
                    started_at=now,
                )
            )
            tenant = s.get(Tenant, job.tenant_id)
        try:
            launch = workloads.job_launch(self.settings, job, tenant, node, list(devices))
            handle = self.executor.start(launch)
        except (StartError, OSError, UserError) as e:  # an attempt, like a non-zero exit
            self._job_ended(job_id, None, None, f"could not start: {e}")
            return
        with self.store.transaction() as s:
            job = s.get(Job, job_id)
            job.pid, job.pid_start_time = handle.pid, handle.start_time

    def _start_replica(self, rid: int, alloc: Allocation, snap: cluster.Snapshot) -> None:
        ((node_name, devices),) = alloc.parts
        port = workloads.free_port()
        now = time.time()
        with self.store.transaction() as s:
            r = s.get(Replica, rid)
            dep = s.get(Deployment, r.deployment_id)
            if r.state != ReplicaState.PENDING or dep.state != deployment_service.ACTIVE:
                return
            node = s.get(Node, snap.nodes[node_name])
            deployment_service.set_replica_state(r, ReplicaState.STARTING)
            r.node_id, r.devices, r.port, r.started_at = node.id, list(devices), port, now
            r.log_path = str(self.settings.replica_log(r.id))
            s.add(
                UsageRecord(
                    tenant_id=dep.tenant_id,
                    replica_id=r.id,
                    gpu_type=alloc.gpu_type,
                    gpus=len(devices),
                    started_at=now,
                )
            )
            tenant = s.get(Tenant, dep.tenant_id)
        try:
            launch = workloads.replica_launch(
                self.settings, dep, tenant, r, node, list(devices), port
            )
            handle = self.executor.start(launch)
        except (StartError, OSError, UserError) as e:
            self._replica_ended(rid, ReplicaState.RESTARTING, None, f"could not start: {e}")
            return
        with self.store.transaction() as s:
            r = s.get(Replica, rid)
            r.pid, r.pid_start_time = handle.pid, handle.start_time

    # --- endings --------------------------------------------------------------------
    def _job_ended(
        self,
        job_id: int,
        to: JobState | None,
        code: int | None,
        reason: str | None,
        lost: bool = False,
    ) -> None:
        """Record how a running job ended; with `to` None, decide from the exit code. A lost
        process (the platform's failure, not the job's) is retried whatever its retries."""
        now = time.time()
        with self.store.transaction() as s:
            job = s.get(Job, job_id)
            if job.state != JobState.RUNNING:
                return
            _close_usage(s, now, job_id=job.id)
            job.exit_code = code
            if to is None:
                to, reason = self._after_exit(job, code, reason, lost, now)
            transition(s, job, to, reason, now)
            self._waiting |= to == JobState.RETRYING
            _clear_process(job)

    def _after_exit(
        self, job: Job, code: int | None, reason: str | None, lost: bool, now: float
    ) -> tuple[JobState, str]:
        if code == 0:
            return JobState.SUCCEEDED, "exit code 0"
        what = reason or describe_exit(code)
        if lost or job.attempts <= job.max_retries:
            delay = self.settings.backoff(job.attempts)
            job.not_before = now + delay
            return JobState.RETRYING, f"{what}; retry in {delay:g} s"
        return JobState.FAILED, f"{what}; no retries left"

    def _replica_ended(
        self, rid: int, to: ReplicaState, code: int | None, reason: str | None = None
    ) -> None:
        """Record how a replica's run ended. RESTARTING counts a restart and backs off, with
        `reason` (a FAILED replica's own reason) and the delay as the replica's reason."""
        now = time.time()
        with self.store.transaction() as s:
            r = s.get(Replica, rid)
            if r.state not in REPLICA_HOLDS_GPUS:
                return
            _close_usage(s, now, replica_id=r.id)
            what = r.reason if r.state == ReplicaState.FAILED else reason
            deployment_service.set_replica_state(r, to)
            r.exit_code = code
            if to == ReplicaState.RESTARTING:
                r.restarts += 1
                delay = self.settings.backoff(r.restarts)
                r.not_before = now + delay
                r.reason = f"{what}; restart in {delay:g} s"
                self._waiting = True
                log.info("replica %s: %s", rid, r.reason)
            _clear_process(r)

    # --- gpucloud down --stop-workloads ----------------------------------------------
    def stop_all(self, reason: str) -> tuple[list[int], list[int]]:
        """Stop every running workload and record it, with no control plane running.

        A job ends CANCELLED with `reason` (one that ended meanwhile is recorded as it
        ended); a replica goes back to PENDING, for its deployment is still wanted: the next
        control plane starts it again. The processes get SIGTERM together and SIGKILL after
        the grace period. Returns the ids of the jobs and replicas stopped.
        """
        with self.store.reading() as s:
            jobs = s.execute(
                select(Job.id, Job.pid, Job.pid_start_time).where(Job.state == JobState.RUNNING)
            ).all()
            replicas = s.execute(
                select(Replica.id, Replica.pid, Replica.pid_start_time).where(
                    Replica.state.in_(REPLICA_HOLDS_GPUS)
                )
            ).all()
        job_handles = {i: self._handle(pid, t, self.settings.job_log(i)) for i, pid, t in jobs}
        ended = {i: self.executor.poll(h) for i, h in job_handles.items() if h is not None}
        handles = [h for i, h in job_handles.items() if ended.get(i) is None]
        handles += [self._handle(pid, t, self.settings.replica_log(i)) for i, pid, t in replicas]
        with ThreadPoolExecutor(max_workers=min(32, max(1, len(handles)))) as pool:
            list(pool.map(self._stop_process, handles))
        stopped = []
        for job_id, exit_ in ((i, ended.get(i)) for i in job_handles):
            if exit_ is not None:
                self._job_ended(job_id, None, exit_.code, None)
            else:
                self._job_ended(job_id, JobState.CANCELLED, None, reason)
                stopped.append(job_id)
        for rid, *_ in replicas:
            self._preempt(f"replica-{rid}")  # its process is gone: this records PENDING
        return stopped, [r[0] for r in replicas]

    # --- process helpers ------------------------------------------------------------
    def _handle(self, pid: int | None, started: float | None, log_path) -> Handle | None:
        if pid is None or started is None:
            return None
        return Handle(log_path.stem, pid, started, f"{log_path}.exit")

    def _stop_process(self, handle: Handle | None) -> Exit | None:
        if handle is None:
            return None
        return self.executor.stop(handle, self.settings.grace_seconds)


def _close_usage(
    session, now: float, job_id: int | None = None, replica_id: int | None = None
) -> None:
    q = select(UsageRecord).where(UsageRecord.ended_at.is_(None))
    q = (
        q.where(UsageRecord.job_id == job_id)
        if job_id
        else q.where(UsageRecord.replica_id == replica_id)
    )
    for rec in session.scalars(q):
        rec.ended_at = now


def _clear_process(row: Job | Replica) -> None:
    row.pid = row.pid_start_time = None
    row.node_id = None
    row.devices = []
    if isinstance(row, Replica):
        row.port = None
