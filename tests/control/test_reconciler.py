"""The reconciler in-process on a real store: it knows when nothing is in flight (its loop
then rests until an API call wakes it) and when something is, down to a backoff begun in
the very pass that ended the job."""

from __future__ import annotations

import dataclasses
import time

import psutil
import pytest
from sqlalchemy import event, select

from gpucloud.control import executors, server, tenancy
from gpucloud.control.auth import authenticate
from gpucloud.control.config import Settings
from gpucloud.control.errors import ConflictError
from gpucloud.control.executors.local import LocalExecutor
from gpucloud.control.lifecycle import FINISHED, JobState, NodeState, ReplicaState
from gpucloud.control.models import AuditEntry, Deployment, Job, Node, Replica
from gpucloud.control.reconciler import Reconciler
from gpucloud.control.schemas import DeploymentSpec, JobSpec
from gpucloud.control.services import deployments, jobs, nodes
from gpucloud.errors import CapacityError
from gpucloud.scheduler import Wait

from .conftest import wait_for


def _until(rec: Reconciler, store, done, timeout: float = 30.0) -> None:
    """Run passes until `done(session)` holds after one."""
    deadline = time.monotonic() + timeout
    while True:
        rec.reconcile()
        with store.reading() as s:
            if done(s):
                return
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_idle_only_when_nothing_runs_waits_or_backs_off(db_url, tmp_path):
    settings = Settings(
        home=tmp_path, db_url=db_url, virtual_gpus=2, node_name="n1", retry_backoff=60.0,
        grace_seconds=2.0,
    )  # fmt: skip
    executor = executors.create(settings)
    store, key = server.prepare(settings, executor)
    rec = Reconciler(store, settings, executor)
    try:
        rec.reconcile()
        assert rec.idle  # an empty cluster
        with store.transaction() as s:
            who = authenticate(s, key)
            job = jobs.submit(s, who, JobSpec(name="j", command="exit 3", gpus=1, max_retries=1))
        rec.reconcile()
        assert not rec.idle  # it was queued (and is now started)
        _until(rec, store, lambda s: s.get(Job, job.id).state != JobState.RUNNING)
        with store.reading() as s:
            assert s.get(Job, job.id).state == JobState.RETRYING
        assert not rec.idle  # the pass that failed it knows it backs off for 60 s
        rec.reconcile()
        assert not rec.idle
        with store.transaction() as s:
            jobs.cancel(s, who, job.id)
        rec.reconcile()
        assert rec.idle

        spec = DeploymentSpec(name="m", model_dir="/m", replicas=1, command="sleep 30")
        with store.transaction() as s:
            deployments.create(s, who, spec)
        rec.reconcile()
        assert not rec.idle  # a replica starting
        rec.reconcile()
        assert not rec.idle  # and not ready: it is probed on every pass
        with store.transaction() as s:
            deployments.delete(s, who, "m")
        _until(rec, store, lambda s: s.query(Deployment).one().state == deployments.DELETED)
        rec.reconcile()
        assert rec.idle
    finally:
        rec.stop()
        store.close()


def test_cpu_and_memory_requests_are_held_granted_and_admitted(db_url, tmp_path):
    """A job whose CPUs are not free waits though GPUs are; one without requests runs; the
    grant reaches the process; a request no node could hold is refused at submit."""
    settings = Settings(
        home=tmp_path, db_url=db_url, virtual_gpus=4, node_name="n1", node_cpus=2,
        node_memory_gib=4, grace_seconds=1.0,
    )  # fmt: skip
    executor = executors.create(settings)
    store, key = server.prepare(settings, executor)
    rec = Reconciler(store, settings, executor)
    grant = "^(GPUCLOUD_CPUS|GPUCLOUD_MEMORY_MIB|OMP_NUM_THREADS)="
    try:
        with store.transaction() as s:
            who = authenticate(s, key)
            env_file = tenancy.area(settings, who.tenant_name) / "a.env"  # where it may write
            a = jobs.submit(s, who, JobSpec(
                name="a", command=f"env | grep -E '{grant}' | sort > {env_file}; sleep 30",
                cpus=1.5, memory_gib=1.25))  # fmt: skip
            b = jobs.submit(s, who, JobSpec(name="b", command="sleep 30", cpus=1))
            c = jobs.submit(s, who, JobSpec(name="c", command="sleep 30"))
            with pytest.raises(CapacityError, match=r"^3 CPUs with 1 GPU.* \(n1\) has 2 CPUs"):
                jobs.submit(s, who, JobSpec(name="e", command="true", cpus=3))
            with pytest.raises(CapacityError, match="5 GiB of memory"):
                jobs.submit(s, who, JobSpec(name="f", command="true", memory_gib=5))
        _until(rec, store, lambda s: s.get(Job, c.id).state == JobState.RUNNING)
        with store.reading() as s:
            assert s.get(Job, a.id).state == JobState.RUNNING
            assert s.get(Job, b.id).state == JobState.PENDING  # 0.5 CPUs free, 2 GPUs idle
            assert s.get(Job, b.id).reason == Wait.HOST
            (node,) = nodes.list_(s, authenticate(s, key))
        assert (node.cpus, node.cpus_allocated) == (2, 1.5)
        assert (node.memory_gib, node.memory_gib_allocated) == (4, 1.25)
        assert node.gpus_allocated == 2
        wait_for(lambda: env_file.exists() and env_file.read_text())
        assert env_file.read_text().split() == [
            "GPUCLOUD_CPUS=1.5", "GPUCLOUD_MEMORY_MIB=1280", "OMP_NUM_THREADS=1"
        ]  # fmt: skip
        with store.transaction() as s:
            jobs.cancel(s, who, a.id)
        _until(rec, store, lambda s: s.get(Job, b.id).state == JobState.RUNNING)
        # a replica's request is held per replica: 1.5 CPUs wait while b holds 1 of 2
        with store.transaction() as s:
            for name, cpus in (("big", 1.5), ("small", 0.5)):
                spec = DeploymentSpec(name=name, model_dir="/m", command="sleep 30", cpus=cpus)
                deployments.create(s, who, spec)
        _until(rec, store, lambda s: _replica_state(s, "small") == ReplicaState.STARTING)
        with store.reading() as s:
            assert _replica_state(s, "big") == ReplicaState.PENDING
    finally:
        with store.transaction() as s:
            for job in (a, b, c):
                if s.get(Job, job.id).state not in FINISHED:
                    jobs.cancel(s, authenticate(s, key), job.id)
            for name in ("big", "small"):
                if s.scalar(select(Deployment).where(Deployment.name == name)):
                    deployments.delete(s, authenticate(s, key), name)
        _until(rec, store, lambda s: all(s.get(Job, j.id).state in FINISHED for j in (a, b, c)))
        _until(rec, store, lambda s: _replica_state(s, "small") in (None, ReplicaState.STOPPED))
        rec.stop()
        store.close()


def _replica_state(session, deployment: str) -> str | None:
    q = select(Replica.state).join(Deployment).where(Deployment.name == deployment)
    return session.scalar(q)


def _a_job_and_a_replica_running(rec: Reconciler, store, key: str) -> Job:
    """Start a job and a deployment's replica (each sleeping, on 1 GPU); returns the job."""
    with store.transaction() as s:
        who = authenticate(s, key)
        job = jobs.submit(s, who, JobSpec(name="j", command="sleep 60", gpus=1))
        spec = DeploymentSpec(name="d", model_dir="/m", command="sleep 60 # {port}")
        deployments.create(s, who, spec)
    _until(rec, store, lambda s: s.get(Job, job.id).state == JobState.RUNNING
           and _replica_state(s, "d") == ReplicaState.STARTING)  # fmt: skip
    return job


class _Machine(LocalExecutor):
    """This machine, whose executor can be told to report it unhealthy or not at all (what
    Ray and Slurm report of a node that died)."""

    health: tuple[bool, str | None] | None = (True, None)  # None: not reported

    def inventory(self):
        if self.health is None:
            return []
        healthy, reason = self.health
        return [dataclasses.replace(self.node, healthy=healthy, reason=reason)]


def test_a_job_whose_only_node_is_down_says_so_and_runs_when_it_is_back(db_url, tmp_path):
    settings = Settings(home=tmp_path, db_url=db_url, virtual_gpus=1, node_name="n1")
    executor = _Machine(settings)
    store, key = server.prepare(settings, executor)
    rec = Reconciler(store, settings, executor)
    try:
        with store.transaction() as s:
            job = jobs.submit(s, authenticate(s, key), JobSpec(name="j", command="true"))
        executor.health = (False, "GPU 0 fell off the bus")
        rec.reconcile()
        with store.reading() as s:
            assert s.get(Job, job.id).reason == "waiting for a node of its GPU type to come up"
            node = s.scalars(select(Node)).one()
            assert (node.state, node.reason) == (NodeState.DOWN, "GPU 0 fell off the bus")
        executor.health = (True, None)
        _until(rec, store, lambda s: s.get(Job, job.id).state == JobState.SUCCEEDED)
        with store.reading() as s:
            assert (s.scalars(select(Node)).one().state, s.get(Job, job.id).attempts) == (
                NodeState.READY, 1
            )  # fmt: skip
    finally:
        rec.stop()
        store.close()


def test_work_on_a_node_that_goes_down_is_failed_over(db_url, tmp_path):
    """A node that stops reporting is DOWN after the node timeout: its job is stopped and
    requeued without using one of its retries, its replica replaced (elsewhere, once a node
    is up), each with the node's reason."""
    settings = Settings(home=tmp_path, db_url=db_url, virtual_gpus=2, node_name="n1",
                        node_timeout=1.5, retry_backoff=0.01)  # fmt: skip
    executor = _Machine(settings)
    store, key = server.prepare(settings, executor)
    rec = Reconciler(store, settings, executor)
    try:
        job = _a_job_and_a_replica_running(rec, store, key)
        with store.reading() as s:
            pids = [int(w.handle.split(":")[0]) for w in (s.get(Job, job.id),
                    s.scalars(select(Replica)).one())]  # fmt: skip
        executor.health = None  # the node stops reporting
        rec.reconcile()
        with store.reading() as s:
            assert s.scalars(select(Node)).one().state == NodeState.READY  # not timed out yet
        time.sleep(1.6)  # past the timeout, which is longer than a pass on a loaded machine
        rec.reconcile()
        with store.reading() as s:
            node = s.scalars(select(Node)).one()
            assert (node.state, node.reason) == (NodeState.DOWN, "not reported for 1.5 s")
            j = s.get(Job, job.id)
            assert (j.state, j.attempts, j.requeues) == (JobState.RETRYING, 1, 1), j.reason
            assert j.reason.startswith("node n1 is down (not reported for 1.5 s); requeued")
            r = s.scalars(select(Replica)).one()
            assert (r.state, r.restarts) == (ReplicaState.RESTARTING, 0)
            assert r.reason.startswith("node n1 is down: replaced elsewhere")
            assert r.handle is None and j.handle is None
            downs = s.scalars(select(AuditEntry).where(AuditEntry.action == "node.down"))
            assert [(a.target, a.detail["reason"]) for a in downs] == [
                ("node/n1", "not reported for 1.5 s")
            ]
        assert not any(psutil.pid_exists(pid) for pid in pids)  # stopped, not only recorded
    finally:
        rec.stop()
        store.close()


def test_workloads_stored_unstartable_fail_attempts_instead_of_every_pass(db_url, tmp_path):
    """Rows the API refuses today but an older version stored (a NUL byte in the command or
    environment): each start is a failed attempt with the error as its reason; a job ends
    FAILED after its retries, a replica backs off, and no pass raises."""
    settings = Settings(home=tmp_path, db_url=db_url, virtual_gpus=2, node_name="n1",
                        retry_backoff=0.01)  # fmt: skip
    executor = executors.create(settings)
    store, key = server.prepare(settings, executor)
    rec = Reconciler(store, settings, executor)
    try:
        with store.transaction() as s:
            who = authenticate(s, key)
            job = jobs.submit(s, who, JobSpec(name="j", command="true", max_retries=1))
            spec = DeploymentSpec(name="m", model_dir="/m", command="sleep 30")
            deployments.create(s, who, spec)
        if db_url.startswith("postgresql"):  # it refuses NUL in text: a bad env name instead
            bad_job, bad_env = {"command": "true", "env": {"A=B": "1"}}, {"A=B": "1"}
        else:
            bad_job, bad_env = {"command": "tr\x00ue"}, {"X": "\x00"}
        with store.transaction() as s:
            for field, value in bad_job.items():
                setattr(s.get(Job, job.id), field, value)
            s.scalars(select(Deployment)).one().env = bad_env
        _until(rec, store, lambda s: s.get(Job, job.id).state == JobState.FAILED)
        _until(rec, store, lambda s: s.scalars(select(Replica)).one().restarts >= 2)
        with store.reading() as s:
            failed = s.get(Job, job.id)
            replica = s.scalars(select(Replica)).one()
        assert failed.attempts == 2 and failed.reason.startswith("could not start: ")
        assert failed.reason.endswith("; no retries left")
        assert replica.state in (ReplicaState.RESTARTING, ReplicaState.PENDING)
        assert replica.reason.startswith("could not start: ") and "restart in" in replica.reason
    finally:
        rec.stop()
        store.close()


def test_a_drained_node_moves_its_replicas_and_lets_its_jobs_finish(db_url, tmp_path):
    settings = Settings(home=tmp_path, db_url=db_url, virtual_gpus=2, node_name="n1")
    executor = _Machine(settings)
    store, key = server.prepare(settings, executor)
    rec = Reconciler(store, settings, executor)
    try:
        job = _a_job_and_a_replica_running(rec, store, key)
        with store.transaction() as s:
            assert nodes.set_state(s, authenticate(s, key), "n1", "drain").state == "draining"
        rec.reconcile()
        rec.reconcile()
        with store.reading() as s:
            assert s.get(Job, job.id).state == JobState.RUNNING  # jobs finish where they are
            r = s.scalars(select(Replica)).one()
            assert (r.state, r.restarts) == (ReplicaState.PENDING, 0)  # no other node to go to
            assert [a.action for a in s.scalars(select(AuditEntry))][-1] == "node.drain"
        with store.transaction() as s:
            nodes.set_state(s, authenticate(s, key), "n1", "uncordon")
        _until(rec, store, lambda s: _replica_state(s, "d") == ReplicaState.STARTING)
        executor.health = (False, "fell off the bus")
        rec.reconcile()
        with store.transaction() as s, pytest.raises(ConflictError, match="n1 is down"):
            nodes.set_state(s, authenticate(s, key), "n1", "cordon")
    finally:
        rec.stop()
        store.close()


def test_explaining_a_long_queue_takes_as_few_statements_as_a_short_one(db_url, tmp_path):
    """The pass after a burst writes each new job's reason: in a statement per reason, not
    one per job (on PostgreSQL each is a round trip behind the API's threads: a pass at
    10,000 jobs took seconds). Statements are counted as sent, each row of an executemany
    as one."""
    settings = Settings(home=tmp_path, db_url=db_url, virtual_gpus=1, node_name="n1")
    executor = executors.create(settings)
    store, key = server.prepare(settings, executor)
    rec = Reconciler(store, settings, executor)
    sent = []

    def count(_conn, _cursor, _statement, parameters, _context, executemany) -> None:
        sent.append(len(parameters) if executemany else 1)

    def explained(queued: int) -> int:
        """Statements of the pass after `queued` more jobs were submitted."""
        with store.transaction() as s:
            who = authenticate(s, key)
            spec = JobSpec(name="j", command="true", gpus=1)
            assert all(j.id for j in jobs.submit_many(s, [(who, spec)] * queued))
        sent.clear()
        rec.reconcile()
        with store.reading() as s:
            new = s.scalars(select(Job.reason).order_by(Job.id.desc()).limit(queued)).all()
        assert len(new) == queued and None not in new  # each one's reason was written
        return sum(sent)

    try:
        with store.transaction() as s:  # nothing starts: every job stays queued
            s.scalars(select(Node)).one().state = NodeState.CORDONED
        rec.reconcile()
        event.listen(store.engine, "before_cursor_execute", count)
        assert explained(300) <= explained(3) + 1  # + the reason "queued behind earlier jobs"
    finally:
        rec.stop()
        store.close()


# One store is enough: the run costs seconds of start-up, and the column is PostgreSQL's too
# in test_migrations.
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_training_job_s_straggling_node_is_excluded_from_its_restart(db_url, tmp_path):
    """A real 2-rank training job (gloo, virtual GPUs) with `health.exclude_stragglers` and
    a slow rank 1: the run saves a checkpoint and exits 5 naming its node, n1; the job is
    requeued, no retry used, with an event saying which node was excluded and why, and the
    scheduler leaves it pending on the free cluster, whose only node it avoids."""
    from gpucloud.train.rank_memory import write_random_dataset

    settings = Settings(home=tmp_path, db_url=db_url, virtual_gpus=2, node_name="n1",
                        retry_backoff=0.01, grace_seconds=2.0)  # fmt: skip
    executor = executors.create(settings)
    store, key = server.prepare(settings, executor)
    rec = Reconciler(store, settings, executor)
    with store.reading() as s:
        area = tenancy.area(settings, authenticate(s, key).tenant_name)  # what it may read
    data = write_random_dataset(area / "tokens", 2048, 20_000)
    run = area / "run.toml"
    run.write_text(
        f'[model]\npreset = "tiny"\n[data]\npath = "{data}"\nseq_len = 32\n'
        "[optim]\nglobal_batch = 4\nmicro_batch = 2\nmax_steps = 8\n[checkpoint]\nevery = 100\n"
        "[health]\nstraggler_steps = 2\nexclude_stragglers = true\n"
        "[fault]\nslow_rank = 1\nslow_seconds = 0.2\n"
    )
    try:
        with store.transaction() as s:
            who = authenticate(s, key)
            job = jobs.submit(s, who, JobSpec(name="t", train=str(run), gpus=2, max_retries=0))
        _until(rec, store, lambda s: s.get(Job, job.id).state not in (JobState.PENDING,
                                                                      JobState.RUNNING),
               timeout=240)  # fmt: skip
        with store.reading() as s:
            j = s.get(Job, job.id)
            assert (j.state, j.exit_code, j.requeues, j.avoid_nodes) == (
                JobState.RETRYING, 5, 1, ["n1"]), j.reason  # fmt: skip
            assert "rank 1 on node n1 straggled" in j.reason
            assert j.reason.endswith("requeued without node n1")
        _until(rec, store, lambda s: s.get(Job, job.id).state == JobState.PENDING)
        for _ in range(3):
            rec.reconcile()
        with store.reading() as s:
            assert s.get(Job, job.id).state == JobState.PENDING  # n1 is free, and avoided
            assert s.get(Job, job.id).started_at is not None  # it did run once
    finally:
        rec.stop()
        store.close()
