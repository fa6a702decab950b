"""The reconciler's snapshot of the store (control/cluster.py) on a real store, SQLite and
PostgreSQL: each job's runtime estimate and each tenant's cohort."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from sqlalchemy import select

from gpucloud.control import cluster, db
from gpucloud.control.lifecycle import JobState, NodeState
from gpucloud.control.models import Job, Node, Quota, Tenant, User
from gpucloud.scheduler import Allocation
from gpucloud.scheduler.state import JobState as SJobState


@pytest.fixture
def store(db_url):
    store = db.open_store(db_url)
    yield store
    store.close()


def _tenant(s, name: str, cohort: str | None = None) -> tuple[int, int]:
    tenant = Tenant(name=name, weight=1.0, created_at=0.0, cohort=cohort)
    s.add(tenant)
    s.flush()
    user = User(tenant_id=tenant.id, name="u", role="admin", created_at=0.0)
    s.add_all([user, Quota(tenant_id=tenant.id, gpu_type="L4", gpus=2)])
    s.flush()
    return tenant.id, user.id


def _job(s, ids: tuple[int, int], name: str, state: JobState, **kw) -> int:
    job = Job(tenant_id=ids[0], user_id=ids[1], name=name, gpus=1, priority="normal",
              preemptible=True, max_retries=0, state=state, submitted_at=1.0, **kw)  # fmt: skip
    s.add(job)
    s.flush()
    return job.id


def test_a_job_is_estimated_by_its_time_limit_else_by_its_tenants_history(store):
    with store.transaction() as s:
        s.add(Node(name="n", gpu_type="L4", gpus=4, link_domain=4, backend="cpu",
                   state=NodeState.READY, heartbeat_at=0.0, created_at=0.0))  # fmt: skip
        a, b = _tenant(s, "a"), _tenant(s, "b")
        for ran in (100.0, 300.0):  # a's jobs have run 200 s on average
            _job(s, a, "done", JobState.SUCCEEDED, started_at=10.0, finished_at=10.0 + ran)
        _job(s, a, "failed", JobState.FAILED, started_at=10.0, finished_at=9000.0)
        limited = _job(s, a, "limited", JobState.PENDING, time_limit=50.0)
        unlimited = _job(s, a, "unlimited", JobState.PENDING)
        newcomer = _job(s, b, "newcomer", JobState.PENDING)
    with store.reading() as s:
        jobs = cluster.load(s).state.pending
    assert jobs[f"job-{limited}"].estimate == 50.0
    assert jobs[f"job-{unlimited}"].estimate == pytest.approx(200.0)
    assert jobs[f"job-{newcomer}"].estimate is None  # no history: the scheduler's default


def test_tenants_of_a_cohort_borrow_from_it_and_the_others_from_nobody(store):
    with store.transaction() as s:
        _tenant(s, "a", "lab"), _tenant(s, "b", "lab"), _tenant(s, "c")
    with store.reading() as s:
        tenants = cluster.load(s).state.tenants
    assert (tenants["a"].borrow, tenants["a"].cohort) == (True, "lab")
    assert tenants["b"].cohort == "lab"
    assert not tenants["c"].borrow and tenants["c"].cohort not in ("lab", "default")


def test_a_train_job_without_a_time_limit_is_estimated_by_the_planner(store):
    from gpucloud.control.auth import Principal
    from gpucloud.control.lifecycle import Role
    from gpucloud.control.schemas import JobSpec
    from gpucloud.control.services import jobs
    from gpucloud.train import config, plan

    train = str(Path(__file__).parents[2] / "examples/train/tiny-ddp.toml")
    with store.transaction() as s:
        s.add(Node(name="n", gpu_type="L4", gpus=4, link_domain=4, backend="cpu",
                   state=NodeState.READY, heartbeat_at=0.0, created_at=0.0))  # fmt: skip
        ids = _tenant(s, "a")
        _job(s, ids, "done", JobState.SUCCEEDED, started_at=10.0, finished_at=9010.0)
        who = Principal(ids[0], "a", ids[1], "u", Role.ADMIN, False, 0, None, None)
        spec = {"name": "t", "train": train, "gpus": 2}
        planned = jobs.submit(s, who, JobSpec(**spec)).id
        limited = jobs.submit(s, who, JobSpec(**spec, time_limit=60)).id
        command = jobs.submit(s, who, JobSpec(name="c", command="true")).id
    with store.reading() as s:
        pending = cluster.load(s).state.pending
    # steps x step time for 2 L4s (the only pool): neither the tenant's 9,000 s mean nor
    # a number the planner would give another GPU
    want = plan.steps_seconds(config.load(train), "L4", 2, 1)
    assert pending[f"job-{planned}"].estimate == pytest.approx(want)
    assert want != pytest.approx(plan.steps_seconds(config.load(train), "H100-SXM", 2, 1))
    assert pending[f"job-{limited}"].estimate == 60.0  # the time limit comes first
    assert pending[f"job-{command}"].estimate == pytest.approx(9000.0)  # no plan: history


def _view(state) -> dict[str, tuple]:
    """What the store decides of each job in a state: its request, its run, and a pending
    job's estimate (a running job keeps the one it started with, as in the simulator)."""
    return {
        j.id: (j.cpu_milli, j.avoid_nodes, j.priority, j.state,
               j.allocation.parts if j.allocation else j.estimate)
        for j in (*state.pending.values(), *state.running.values())
    }  # fmt: skip


def test_the_state_kept_between_passes_follows_the_store(store):
    """A kept state (`LiveCluster`) is the state a pass without it builds, after
    submissions, a run that starts, one that comes back with a node to avoid and a new
    time limit, a cancel, a run that ends, a start and a preemption the store did not
    follow, and a node cordoned; and it is the same object throughout, with its jobs'
    arrival order."""
    with store.transaction() as s:
        s.add(Node(name="n", gpu_type="L4", gpus=4, link_domain=4, backend="cpu",
                   state=NodeState.READY, heartbeat_at=0.0, created_at=0.0))  # fmt: skip
        ids = _tenant(s, "a")
        first = [_job(s, ids, f"j{i}", JobState.PENDING) for i in range(4)]
    kept = cluster.LiveCluster()

    def both():
        with store.reading() as s:
            incremental = kept.load(s, 100.0).state
            fresh = cluster.load(s).state
        assert _view(incremental) == _view(fresh)
        return incremental

    state = both()
    arrival = {j.id: j.seq for j in state.pending.values()}
    assert set(arrival) == {f"job-{j}" for j in first}
    with store.transaction() as s:  # one more submitted; the first two run
        added = _job(s, ids, "late", JobState.PENDING, cpu_milli=2000)
        for jid, gpu in ((first[0], 0), (first[1], 1)):
            job = s.get(Job, jid)
            job.state, job.attempts, job.started_at = JobState.RUNNING, 1, 10.0
            job.placement = [{"node": "n", "devices": [gpu]}]
    assert both() is state
    assert state.running[f"job-{first[0]}"].allocation.parts == (("n", (0,)),)
    assert state.pending[f"job-{added}"].cpu_milli == 2000
    with store.transaction() as s:  # the first comes back; the second ends; a cancel
        job = s.get(Job, first[0])
        job.state, job.placement, job.avoid_nodes, job.time_limit = (
            JobState.PENDING, None, ["bad-node"], 30.0)  # fmt: skip
        done = s.get(Job, first[1])
        done.state, done.finished_at = JobState.SUCCEEDED, 70.0
        s.get(Job, first[2]).state = JobState.CANCELLED
    assert both() is state
    back = state.pending[f"job-{first[0]}"]
    assert (back.avoid_nodes, back.estimate, back.seq) == (
        frozenset({"bad-node"}), 30.0, arrival[back.id])  # fmt: skip
    assert [j.id for j in state.ended] == [f"job-{first[1]}"]  # ran 60 s: calibrates
    assert state.ended[0].run_time == pytest.approx(60.0)
    assert f"job-{first[2]}" not in state.jobs

    # A pass's decisions start jobs in its state; the store may not follow (the start
    # failed): the next pass has it pending again, the same job at the same place.
    started = state.pending[f"job-{first[3]}"]
    state.start(started, Allocation("L4", (("n", (2,)),)), 105.0)
    assert both().pending[started.id] is started
    assert (started.state, started.allocation, started.seq) == (
        SJobState.PENDING, None, arrival[started.id])  # fmt: skip

    # A preemption the store did not follow either: the victim, pending in the state,
    # is in neither of the store's queues (retrying), and leaves the state.
    with store.transaction() as s:
        job = s.get(Job, added)
        job.state, job.attempts, job.started_at = JobState.RUNNING, 1, 110.0
        job.placement = [{"node": "n", "devices": [3]}]
    victim = both().running[f"job-{added}"]
    state.preempt(victim, 120.0)
    with store.transaction() as s:
        s.get(Job, added).state = JobState.RETRYING
    assert victim.id not in both().jobs

    with store.transaction() as s:  # cordoned, then a second node: a state built anew
        s.scalars(select(Node)).one().state = NodeState.CORDONED
    assert both() is state and state.nodes["n"].cordoned
    with store.transaction() as s:
        s.add(Node(name="m", gpu_type="L4", gpus=4, link_domain=4, backend="cpu",
                   state=NodeState.READY, heartbeat_at=0.0, created_at=0.0))  # fmt: skip
    assert both() is not state


@pytest.mark.parametrize("seed", range(6))
def test_a_kept_state_stays_the_state_built_anew_through_random_changes(store, seed):
    """Random store changes (submissions, starts, ends, requeues, cancels, cordons) mixed
    with decisions the store does not follow (starts and preemptions made in the kept state
    only): after each pass the kept state holds what a state built anew holds."""
    rng = random.Random(seed)
    with store.transaction() as s:
        s.add(Node(name="n", gpu_type="L4", gpus=8, link_domain=8, backend="cpu",
                   state=NodeState.READY, heartbeat_at=0.0, created_at=0.0))  # fmt: skip
        ids = _tenant(s, "a")
    kept = cluster.LiveCluster()
    now = 100.0
    for _ in range(60):
        now += rng.uniform(5.0, 50.0)
        with store.transaction() as s:
            jobs = s.scalars(select(Job)).all()
            pending = [j for j in jobs if j.state == JobState.PENDING]
            running = [j for j in jobs if j.state == JobState.RUNNING]
            used = {d for j in running for p in j.placement for d in p["devices"]}
            move = rng.choice(("submit", "start", "end", "requeue", "cancel", "cordon"))
            if move == "submit" or not jobs:
                _job(s, ids, "j", JobState.PENDING, time_limit=rng.choice((None, 60.0)))
            elif move == "start" and pending and len(used) < 8:
                job = rng.choice(pending)
                free = rng.choice(sorted(set(range(8)) - used))
                job.state, job.attempts, job.started_at = JobState.RUNNING, job.attempts + 1, now
                job.placement = [{"node": "n", "devices": [free]}]
            elif move == "end" and running:
                job = rng.choice(running)
                job.state = rng.choice((JobState.SUCCEEDED, JobState.SUCCEEDED, JobState.FAILED))
                job.finished_at, job.placement = now, None
            elif move == "requeue" and running:
                job = rng.choice(running)
                job.state, job.placement = JobState.PENDING, None
                job.avoid_nodes = rng.choice((None, ["elsewhere"]))
            elif move == "cancel" and pending:
                rng.choice(pending).state = JobState.CANCELLED
            elif move == "cordon":
                node = s.scalars(select(Node)).one()
                node.state = rng.choice((NodeState.READY, NodeState.CORDONED))
        with store.reading() as s:
            state = kept.load(s, now).state
            assert _view(state) == _view(cluster.load(s).state)
        # a pass's decisions, which the store may not follow
        if state.pending and rng.random() < 0.5:
            free = [g for g, milli in enumerate(state.nodes["n"].free_milli) if milli == 1000]
            if free:
                job = rng.choice(list(state.pending.values()))
                state.start(job, Allocation("L4", (("n", (free[0],)),)), now)
        if state.running and rng.random() < 0.3:
            state.preempt(rng.choice(list(state.running.values())), now)
