"""The canary's share of the requests (exact per request, sticky per user) and the bounds
that roll a canary back, on fabricated samples; then a canary that does not get going and
a draining replica, with an in-process reconciler. The live rollout is in test_gateway."""

from __future__ import annotations

import time

from sqlalchemy import select

from gpucloud.control import executors, server
from gpucloud.control.auth import authenticate
from gpucloud.control.config import Settings
from gpucloud.control.lifecycle import VersionState
from gpucloud.control.models import AuditEntry, Deployment, DeploymentVersion, Replica
from gpucloud.control.reconciler import Reconciler
from gpucloud.control.replica_stats import ReplicaStats
from gpucloud.control.rollback import AutoRollback, Starts, judge, judge_starts
from gpucloud.control.schemas import CanaryGuard, DeploymentSpec, RolloutSpec
from gpucloud.control.services import deployments, versions
from gpucloud.control.traffic import Canary, Splitter, sticky_bucket

STABLE, CANARY = (1, "http://s"), (2, "http://c")


def _firsts(splitter: Splitter, canary: Canary, n: int, user=None) -> list[int]:
    return [splitter.groups(7, [STABLE, CANARY], canary, user)[0][0][0] for _ in range(n)]


def test_each_run_of_requests_gets_its_exact_share_and_the_other_version_comes_next():
    splitter = Splitter()
    canary = Canary(10.0, frozenset({2}))
    firsts = _firsts(splitter, canary, 100)
    assert firsts.count(2) == 10 and firsts[9] == 2 and firsts[:9].count(2) == 0
    assert _firsts(splitter, Canary(37.5, frozenset({2})), 8).count(2) == 3
    # the chosen version first, the other after: a request its version refuses goes on
    assert splitter.groups(7, [STABLE, CANARY], canary, None) in ([[STABLE], [CANARY]],
                                                                  [[CANARY], [STABLE]])  # fmt: skip
    # no canary replica ready: stable only, whatever the draw
    assert all(splitter.groups(7, [STABLE], canary, None) == [[STABLE]] for _ in range(20))
    assert splitter.groups(7, [STABLE, CANARY], None, "ann") == [[STABLE, CANARY]]


def test_a_user_stays_on_one_version_and_users_split_by_the_share():
    splitter = Splitter()
    canary = Canary(30.0, frozenset({2}))
    for user in ("ann", "bob", "cy"):
        assert len(set(_firsts(splitter, canary, 20, user))) == 1
    users = [f"user-{i}" for i in range(4000)]
    on_canary = sum(splitter.picks_canary(7, 30.0, u) for u in users) / len(users)
    assert 0.27 < on_canary < 0.33
    assert sticky_bucket("ann") == sticky_bucket("ann") and 0 <= sticky_bucket("ann") < 10_000


def _window(stats: ReplicaStats, rid: int, answers: list[tuple[int, float]]):
    for status, ttft in answers:
        stats.observe(rid, 100.0, status, ttft)
    return stats.window([rid], since=50.0)


def test_a_canary_is_judged_only_on_enough_requests_and_against_stable():
    stats = ReplicaStats()
    guard = CanaryGuard(min_requests=10, max_error_rate_increase=0.1, max_ttft_ratio=2.0)
    stable = _window(stats, 1, [(200, 0.1)] * 18 + [(500, 0.0)] * 2)  # 10% errors
    assert judge(_window(stats, 2, [(500, 0.0)] * 9), stable, guard) is None  # too few yet
    assert judge(_window(stats, 3, [(200, 0.1)] * 8 + [(500, 0.0)] * 2), stable, guard) is None
    why = judge(_window(stats, 4, [(200, 0.1)] * 7 + [(599, 0.0)] * 3), stable, guard)
    assert why.startswith("canary error rate 30.0% vs stable 10.0% over the last 60 s")
    slow = judge(_window(stats, 5, [(200, 0.1)] * 9 + [(200, 0.5)]), stable, guard)
    assert slow.startswith("canary p99 time to first token 0.500 s vs stable 0.100 s")
    assert stats.window([1], since=150.0).requests == 0  # older than the window
    stats.forget({1})
    assert stats.window([2, 3], since=0.0).requests == 0


def test_a_canary_that_does_not_get_going_is_judged_on_its_starts():
    guard = CanaryGuard(max_restarts=3, ready_within=300)
    assert judge_starts(Starts(restarts=2, ready=False, age=10.0), guard) is None
    crashing = judge_starts(Starts(restarts=3, ready=True, age=10.0), guard)
    assert crashing == (
        "canary replicas restarted 3 times (at most 2 allowed): they crash or fail their probes"
    )
    assert judge_starts(Starts(restarts=0, ready=True, age=1e6), guard) is None  # was ready
    never = judge_starts(Starts(restarts=0, ready=False, age=301.0), guard)
    assert never == "no canary replica ready 300 s after the first one was created"


def _passes(rec: Reconciler, store, done, timeout: float = 30.0):
    """Run reconciler passes until `done(session)` returns something truthy; return it."""
    deadline = time.monotonic() + timeout
    while True:
        rec.reconcile()
        with store.reading() as s:
            if found := done(s):
                return found
        assert time.monotonic() < deadline, f"timed out waiting for {done}"
        time.sleep(0.05)


def _states(session, version: int) -> list[str]:
    """The states of the replicas of version `version` (of the only deployment)."""
    v = session.scalar(select(DeploymentVersion).where(DeploymentVersion.number == version))
    return [r.state for r in session.scalars(select(Replica).where(Replica.version_id == v.id))]


def test_a_crash_looping_canary_is_rolled_back_and_a_draining_replica_stopped_at_the_limit(
    db_url, tmp_path
):
    """In-process reconciler, real processes: a canary whose server exits at once is rolled
    back after `max_restarts`, audited; one that keeps a request open (the gateway never
    says it drained) is stopped `drain_limit` seconds after its version ended."""
    settings = Settings(home=tmp_path, db_url=db_url, virtual_gpus=2, node_name="n1",
                        retry_backoff=0.01, drain_limit=2.0)  # fmt: skip
    executor = executors.create(settings)
    store, key = server.prepare(settings, executor)
    rec = Reconciler(store, settings, executor)
    rec.auto_rollback = AutoRollback(ReplicaStats())
    rec.drained = lambda rid, since: False  # a stream stays open on every replica
    try:
        with store.transaction() as s:
            who = authenticate(s, key)
            deployments.create(s, who, DeploymentSpec(name="d", model_dir="/m",
                                                      command="sleep 60 # {port}"))  # fmt: skip
            spec = RolloutSpec(model_dir="/m", command="exit 3 # {port}", canary=50,
                               guard=CanaryGuard(max_restarts=2))  # fmt: skip
            deployments.rollout(s, who, "d", spec)
        ended = _passes(rec, store, lambda s: s.scalar(select(DeploymentVersion.reason).where(
            DeploymentVersion.state == VersionState.ROLLED_BACK)))  # fmt: skip
        assert ended == "automatic: canary replicas restarted 2 times (at most 1 allowed): " \
            "they crash or fail their probes"  # fmt: skip
        with store.reading() as s:
            audited = s.scalars(select(AuditEntry).where(
                AuditEntry.action == "deployment.rollback")).one()  # fmt: skip
            assert audited.user_id is None and audited.detail["reason"] == ended

        spec = RolloutSpec(model_dir="/m", command="sleep 60 # {port}", canary=50)
        with store.transaction() as s:
            deployments.rollout(s, authenticate(s, key), "d", spec)
        _passes(rec, store, lambda s: _states(s, 3) == ["STARTING"])
        with store.transaction() as s:
            who = authenticate(s, key)
            deployments.rollback(s, who, deployments.get(s, who, "d"), "by hand")
        rec.reconcile()
        with store.reading() as s:  # its version ended, a request is open: it drains
            assert _states(s, 3) == ["STARTING"]
        _passes(rec, store, lambda s: _states(s, 3) == ["STOPPED"])
    finally:
        rec.stop()
        store.close()


def test_samples_from_before_a_restart_and_after_it_decide_the_rollback(db_url, tmp_path):
    """The gateway's samples of a guarded canary's deployment are stored each pass: a
    control plane that restarts (a new ReplicaStats) judges its window on the samples from
    before the restart and after it. 6 canary errors before and 4 after make the 10
    requests the guard needs; either part alone does not."""
    settings = Settings(home=tmp_path, db_url=db_url, virtual_gpus=2, node_name="n1")
    store, key = server.prepare(settings, executors.create(settings))
    try:
        with store.transaction() as s:
            who = authenticate(s, key)
            deployments.create(s, who, DeploymentSpec(name="d", model_dir="/m"))
            spec = RolloutSpec(model_dir="/m", canary=50, guard=CanaryGuard(min_requests=10))
            deployments.rollout(s, who, "d", spec)
        with store.reading() as s:
            stable, canary = (
                s.scalars(select(Replica.id).join(DeploymentVersion, Replica.version_id
                                                  == DeploymentVersion.id)
                          .where(DeploymentVersion.number == n)).one()
                for n in (1, 2)
            )  # fmt: skip
        now = time.time()
        before = AutoRollback(ReplicaStats())
        for i in range(10):
            before.stats.observe(stable, now - 30 + i, 200, 0.1)
        for i in range(6):
            before.stats.observe(canary, now - 20 + i, 500, None)
        before.apply(store, now)
        with store.reading() as s:  # 6 canary requests: too few to judge
            assert VersionState.CANARY in versions.served(s, s.scalar(select(Deployment.id)))
        after = AutoRollback(ReplicaStats())  # the control plane restarted
        for i in range(4):
            after.stats.observe(canary, now + i, 500, None)
        assert after.stats.window([canary], now - 60).requests == 4  # not loaded yet
        after.apply(store, now + 5)
        with store.reading() as s:
            reason = s.scalar(select(DeploymentVersion.reason).where(
                DeploymentVersion.state == VersionState.ROLLED_BACK))  # fmt: skip
        assert reason.startswith("automatic: canary error rate 100.0% vs stable 0.0% over "
                                 "the last 60 s (10 canary requests)")  # fmt: skip
    finally:
        store.close()
