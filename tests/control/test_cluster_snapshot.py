"""The reconciler's snapshot of the store (control/cluster.py) on a real store, SQLite and
PostgreSQL: each job's runtime estimate and each tenant's cohort."""

from __future__ import annotations

import pytest

from gpucloud.control import cluster, db
from gpucloud.control.lifecycle import JobState, NodeState
from gpucloud.control.models import Job, Node, Quota, Tenant, User


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
