"""The reconciler's snapshot of the store (control/cluster.py) on a real store, SQLite and
PostgreSQL: each job's runtime estimate and each tenant's cohort."""

from __future__ import annotations

from pathlib import Path

import pytest

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


def test_the_pending_rows_kept_between_passes_follow_the_store(store):
    """A pass reads whole rows only for jobs it has not read at their attempt count; what
    it builds is what a pass without the kept rows builds, after submissions, a run that
    ends with a node to avoid, and a cancel."""
    with store.transaction() as s:
        s.add(Node(name="n", gpu_type="L4", gpus=4, link_domain=4, backend="cpu",
                   state=NodeState.READY, heartbeat_at=0.0, created_at=0.0))  # fmt: skip
        ids = _tenant(s, "a")
        first = [_job(s, ids, f"j{i}", JobState.PENDING) for i in range(3)]

    kept = cluster.PendingRows()

    def both() -> dict[str, tuple]:
        def view(rows):
            with store.reading() as s:
                jobs = cluster.load(s, rows).state.pending
            return {
                j: (v.cpu_milli, v.avoid_nodes, v.estimate, v.priority, v.state, v.seq,
                    v.allocation, v.start_time, v.attained)
                for j, v in jobs.items()
            }  # fmt: skip

        fresh, incremental = view(None), view(kept)
        assert incremental == fresh
        return incremental

    assert set(both()) == {f"job-{j}" for j in first}
    with store.transaction() as s:  # one more submitted; the first ran, and came back
        added = _job(s, ids, "late", JobState.PENDING, cpu_milli=2000)
        job = s.get(Job, first[0])
        job.attempts, job.avoid_nodes, job.time_limit = 1, ["bad-node"], 30.0
    seen = both()
    assert seen[f"job-{added}"][0] == 2000
    assert seen[f"job-{first[0]}"][1:3] == (frozenset({"bad-node"}), 30.0)
    with store.transaction() as s:
        s.get(Job, first[1]).state = JobState.CANCELLED
    assert f"job-{first[1]}" not in both()

    # A pass's decisions start jobs in its state; the store may not follow (the start
    # failed): the next pass's job, reused from the kept ones, is pending as if new.
    with store.reading() as s:
        state = cluster.load(s, kept).state
    started = state.pending[f"job-{first[2]}"]
    state.start(started, Allocation("L4", (("n", (0,)),)), 5.0)
    assert started.state is SJobState.RUNNING
    with store.reading() as s:
        again = cluster.load(s, kept).state.pending[started.id]
    assert again is started  # reused, not built again
    assert (again.state, again.allocation, again.start_time) == (SJobState.PENDING, None, None)
    both()
