"""The canary's share of the requests (exact per request, sticky per user) and the bounds
that roll a canary back, on fabricated samples; the live rollout is in test_deployments."""

from __future__ import annotations

from gpucloud.control.replica_stats import ReplicaStats
from gpucloud.control.rollback import judge
from gpucloud.control.schemas import CanaryGuard
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
