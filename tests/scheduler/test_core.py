from __future__ import annotations

from gpucloud.scheduler import (
    POLICIES,
    Allocation,
    ClusterState,
    Job,
    Node,
    PlacementConfig,
    Policy,
    Scheduler,
    Tenant,
    Wait,
)
from gpucloud.scheduler.core import Cause, backlog
from scheduler.helpers import BACKLOG, check_invariants, cluster


def _run(state: ClusterState, policy: str | Policy, now: float = 0.0):
    d = Scheduler(POLICIES[policy] if isinstance(policy, str) else policy).schedule(state, now)
    check_invariants(state)
    return d


def _started(d) -> list[str]:
    return [j.id for j, _ in d.starts]


def test_strict_fifo_blocks_behind_the_head_and_easy_backfill_does_not() -> None:
    easy = POLICIES["fifo"].with_(backfill="easy")
    for policy, expect in ((POLICIES["fifo"], ["small"]), (easy, ["small", "short"])):
        state = cluster(1)
        state.submit(Job("small", num_gpus=4, estimate=100))
        state.start(state.submit(Job("busy", num_gpus=2, estimate=50)),
                    Allocation("H100-SXM", (("n0", (6, 7)),)), 0)  # fmt: skip
        state.submit(Job("head", num_gpus=4, estimate=10, submit_time=1))
        state.submit(Job("short", num_gpus=2, estimate=40, submit_time=2))
        state.submit(Job("long", num_gpus=2, estimate=500, submit_time=3))
        d = Scheduler(policy).schedule(state, 0)
        assert _started(d) == expect, policy.backfill  # "long" would delay "head"


def test_easy_reservation_is_not_delayed_by_backfill() -> None:
    state = cluster(1)
    state.start(state.submit(Job("busy", num_gpus=6, estimate=100)),
                Allocation("H100-SXM", (("n0", tuple(range(6))),)), 0)  # fmt: skip
    state.submit(Job("head", num_gpus=8, estimate=10, submit_time=1))
    state.submit(Job("late", num_gpus=2, estimate=1000, submit_time=2))
    state.submit(Job("fits", num_gpus=2, estimate=90, submit_time=3))
    d = Scheduler(POLICIES["fifo"].with_(backfill="easy")).schedule(state, 0)
    assert _started(d) == ["fits"]  # "late" would run past the head's shadow time (100)
    assert d.reservation.job.id == "head" and d.reservation.shadow_time == 100


def test_easy_with_consolidate_reserves_a_node_not_a_gpu_count() -> None:
    # n0 frees 6 GPUs at t=100 and then has 8 for the head; n1 stays at 4 free until t=1000.
    # By GPU count (12 free at t=100, 4 spare) "long" could start, and packing would put it
    # on n0's 2 free GPUs, pushing the head to t=1000. The reservation holds n0 instead.
    policy = POLICIES["fifo"].with_(backfill="easy", placement=PlacementConfig(consolidate=True))
    state = cluster(2)
    state.start(state.submit(Job("a", num_gpus=6, estimate=100)),
                Allocation("H100-SXM", (("n0", tuple(range(6))),)), 0)  # fmt: skip
    state.start(state.submit(Job("b", num_gpus=4, estimate=1000)),
                Allocation("H100-SXM", (("n1", tuple(range(4))),)), 0)  # fmt: skip
    state.submit(Job("head", num_gpus=8, estimate=10, submit_time=1))
    state.submit(Job("long", num_gpus=2, estimate=5000, submit_time=2))
    d = Scheduler(policy).schedule(state, 0)
    check_invariants(state)
    assert d.reservation.node == state.nodes["n0"].index and d.reservation.shadow_time == 100
    assert [(j.id, a.nodes) for j, a in d.starts] == [("long", ("n1",))]
    state.finish(state.get("a"), 100)
    assert _started(Scheduler(policy).schedule(state, 100)) == ["head"]


def test_gpus_on_a_cordoned_node_are_not_counted_on_by_a_reservation() -> None:
    state = cluster(2)
    state.start(state.submit(Job("a", num_gpus=8, estimate=100)),
                Allocation("H100-SXM", (("n0", tuple(range(8))),)), 0)  # fmt: skip
    state.start(state.submit(Job("b", num_gpus=7, estimate=900)),
                Allocation("H100-SXM", (("n1", tuple(range(7))),)), 0)  # fmt: skip
    state.cordon("n0")
    state.submit(Job("head", num_gpus=8, estimate=10, submit_time=1))
    d = Scheduler(POLICIES["fifo"].with_(backfill="easy")).schedule(state, 0)
    assert d.reservation.shadow_time == 900  # n0's GPUs never come back while cordoned


def test_priority_preempts_the_fewest_youngest_victims() -> None:
    state = cluster(1)
    for i, (n, t) in enumerate(((4, 0), (2, 100), (2, 200))):
        job = state.submit(Job(f"low{i}", num_gpus=n))
        gpus = tuple(range(sum((4, 2, 2)[:i]), sum((4, 2, 2)[: i + 1])))
        state.start(job, Allocation("H100-SXM", (("n0", gpus),)), t)
    state.submit(Job("vip", num_gpus=2, priority=10))
    d = _run(state, "priority", now=1000)
    assert [j.id for j in d.preemptions] == ["low2"]  # one victim, the youngest
    assert _started(d) == ["vip"]
    assert {v: (c, j.id) for v, (c, j) in d.preempted_for.items()} == {
        "low2": (Cause.PRIORITY, "vip")
    }
    state.submit(Job("vip2", num_gpus=4, priority=10))
    d = _run(state, "priority", now=2000)
    assert [j.id for j in d.preemptions] == ["low0"]  # one 4-GPU victim beats two 2-GPU ones


def test_a_job_over_quota_borrows_and_its_owner_reclaims() -> None:
    state = cluster(2)
    state.add_tenant(Tenant("a", quota={"H100-SXM": 8}))
    state.add_tenant(Tenant("b", quota={"H100-SXM": 8}))
    state.add_tenant(Tenant("solo", quota={"H100-SXM": 0}, cohort="other"))
    for i in range(4):
        state.submit(Job(f"a{i}", tenant="a", num_gpus=4))
    state.submit(Job("s", tenant="solo", num_gpus=1))
    d = _run(state, "kueue", now=0)
    assert _started(d) == ["a0", "a1", "a2", "a3"]  # a borrows b's idle quota; solo cannot
    assert state.usage["a"]["H100-SXM"] == 16
    state.submit(Job("b0", tenant="b", num_gpus=4))
    d = _run(state, "kueue", now=1000)
    assert [j.id for j in d.preemptions] == ["a3"] and _started(d) == ["b0"]
    assert {v: (c, j.id) for v, (c, j) in d.preempted_for.items()} == {"a3": (Cause.RECLAIM, "b0")}


def test_a_job_may_borrow_the_cohort_s_last_gpus_though_its_quotas_sum_rounds_down() -> None:
    """Six equal shares of 8 GPUs add up to 7.999999999999999: a job needing every GPU had
    no room (on synthetic s2 a due gang so refused preempted 70 jobs for nothing)."""
    state = cluster(1)
    for i in range(6):
        state.add_tenant(Tenant(f"t{i}", quota={"H100-SXM": 8 / 6}))
    state.submit(Job("all", tenant="t0", num_gpus=8, preemptible=True))
    assert _started(_run(state, "kueue")) == ["all"]


def test_a_guarded_job_preempts_nobody_for_gpus_its_quota_would_not_let_it_use() -> None:
    """a's starving job could borrow, but its cohort's quota is all in use (by a and c):
    freeing GPUs of b, in another cohort, would not admit it, so b keeps them."""
    state = cluster(2)
    for name, cohort in (("a", "x"), ("c", "x"), ("b", "y")):
        state.add_tenant(Tenant(name, quota={"H100-SXM": 4 if cohort == "x" else 8}, cohort=cohort))
    for name, node, gpus in (("a", "n0", (0, 1, 2, 3)), ("c", "n0", (4, 5, 6, 7))):
        job = state.submit(Job(f"{name}-old", tenant=name, num_gpus=4, submit_time=0))
        state.start(job, Allocation("H100-SXM", ((node, gpus),)), 0)
    state.submit(Job("starving", tenant="a", num_gpus=4, preemptible=True, submit_time=1))
    for g in range(8):
        job = state.submit(Job(f"b{g}", tenant="b", preemptible=True, submit_time=2))
        state.start(job, Allocation("H100-SXM", (("n1", (g,)),)), 2)
    policy = BACKLOG.with_(starvation_backlog=None, starvation_after=100.0, guard="arrival")
    d = _run(state, policy, now=10_000.0)
    assert not d.preemptions and not d.starts
    assert len(state.running) == 10


def test_a_job_larger_than_its_cohort_s_quota_waits_without_holding_gpus() -> None:
    """No use of the cohort's can ever admit it: it must not hold a reservation that keeps
    other tenants' jobs waiting (it did, as a job with "no room" for now)."""
    state = cluster(1)
    state.add_tenant(Tenant("a", quota={"H100-SXM": 4}, cohort="x"))
    state.add_tenant(Tenant("b", quota={"H100-SXM": 8}, cohort="y"))
    state.submit(Job("huge", tenant="a", num_gpus=8, preemptible=True, submit_time=0))
    state.submit(Job("small", tenant="b", num_gpus=2, submit_time=1))
    d = _run(state, "gpucloud")
    assert _started(d) == ["small"] and d.reservation is None


def test_a_job_started_in_a_pass_is_not_reclaimed_in_that_same_pass() -> None:
    """With min_run 0, a borrower started first in a pass was once preempted by a later job
    of that pass (the simulator then ended a pending job and failed)."""
    state = cluster(1)
    state.add_tenant(Tenant("a", quota={"H100-SXM": 4}))
    state.add_tenant(Tenant("b", quota={"H100-SXM": 4}))
    state.submit(Job("b0", tenant="b", num_gpus=8, preemptible=True))  # borrows a's half
    state.submit(Job("a0", tenant="a", num_gpus=4, submit_time=1.0))
    scheduler = Scheduler(POLICIES["kueue"].with_(min_run=0.0))
    d = scheduler.schedule(state, 10.0)
    assert _started(d) == ["b0"] and d.preemptions == []
    d = scheduler.schedule(state, 11.0)  # a later pass may take a's quota back
    assert [j.id for j in d.preemptions] == ["b0"] and _started(d) == ["a0"]
    check_invariants(state)


def test_no_borrowing_when_the_tenant_may_not() -> None:
    state = cluster(2)
    state.add_tenant(Tenant("a", quota={"H100-SXM": 8}, borrow=False))
    state.add_tenant(Tenant("b", quota={"H100-SXM": 8}))
    for i in range(3):
        state.submit(Job(f"a{i}", tenant="a", num_gpus=4))
    assert _started(_run(state, "kueue")) == ["a0", "a1"]


def test_fair_share_interleaves_tenants_by_dominant_share() -> None:
    state = cluster(1)
    for i in range(4):
        state.submit(Job(f"a{i}", tenant="a", num_gpus=2))
    state.submit(Job("b0", tenant="b", num_gpus=2))
    d = _run(state, "fair")
    assert _started(d) == ["a0", "b0", "a1", "a2"]


def test_a_starving_job_jumps_the_queue_and_preempts() -> None:
    state = cluster(1)
    state.start(state.submit(Job("new", num_gpus=8, estimate=10, submit_time=900_000)),
                Allocation("H100-SXM", (("n0", tuple(range(8))),)), 900_000)  # fmt: skip
    state.submit(Job("old", num_gpus=8, estimate=10**6, submit_time=0))
    policy = BACKLOG.with_(starvation_backlog=None, starvation_after=300 * 3600.0)
    d = Scheduler(policy).schedule(state, 299 * 3600)
    assert not d.preemptions and not d.starts
    d = Scheduler(policy).schedule(state, 400 * 3600)
    assert [j.id for j in d.preemptions] == ["new"] and _started(d) == ["old"]
    assert d.preempted_for["new"][0] is Cause.GUARD


def test_a_starving_job_that_may_not_preempt_reserves_or_blocks() -> None:
    h = 3600.0
    base = BACKLOG.with_(starvation_backlog=None, starvation_after=300 * h)
    for guard, started in (("reserve", ["short"]), ("block", [])):
        state = cluster(1)
        state.start(state.submit(Job("new", num_gpus=4, estimate=10 * h, submit_time=399 * h)),
                    Allocation("H100-SXM", (("n0", (0, 1, 2, 3)),)), 399 * h)  # fmt: skip
        state.submit(Job("old", num_gpus=8, estimate=10**6, submit_time=0))
        state.submit(Job("short", num_gpus=2, estimate=600, submit_time=399 * h))
        d = Scheduler(base.with_(guard=guard)).schedule(state, 400 * h)
        check_invariants(state)
        assert not d.preemptions and _started(d) == started, guard
        assert guard == "block" or d.reservation is not None and d.reservation.job.id == "old"


def test_work_lost_to_a_preemption_counts_as_waiting_for_the_starvation_guard() -> None:
    state = cluster(1)
    old = state.submit(Job("old", num_gpus=8, estimate=10**5, checkpoint_interval=1800))
    state.start(old, Allocation("H100-SXM", (("n0", tuple(range(8))),)), 0)
    state.preempt(old, 1000)  # before its first checkpoint: all 1000 s are lost
    state.start(state.submit(Job("new", num_gpus=8, estimate=10**5, submit_time=1000)),
                Allocation("H100-SXM", (("n0", tuple(range(8))),)), 1000)  # fmt: skip
    policy = BACKLOG.with_(starvation_backlog=None, starvation_after=1500.0)
    d = Scheduler(policy).schedule(state, 2000)  # old waited 2000 s, not 1000
    assert [j.id for j in d.preemptions] == ["new"] and _started(d) == ["old"]


def test_the_backlog_starvation_limit_follows_the_believed_remaining_work() -> None:
    h = 3600.0
    state = cluster(1)
    state.start(state.submit(Job("new", num_gpus=8, estimate=100 * h, submit_time=50 * h)),
                Allocation("H100-SXM", (("n0", tuple(range(8))),)), 50 * h)  # fmt: skip
    state.submit(Job("old", num_gpus=8, estimate=h, submit_time=0))
    assert backlog(state, 60 * h) == 91 * h  # old's hour + new's 90 h left, on 8 GPUs
    d = _run(state, BACKLOG, now=60 * h)  # old waited 60 h < 91 h
    assert not d.preemptions and not d.starts
    d = _run(state, BACKLOG, now=100 * h)  # 100 h >= 1 h + 50 h left
    assert [j.id for j in d.preemptions] == ["new"] and _started(d) == ["old"]


def test_the_backlog_is_calibrated_by_observed_run_times() -> None:
    h = 3600.0
    state = cluster(1)
    done = state.submit(Job("done", num_gpus=8, estimate=4 * h))
    state.start(done, Allocation("H100-SXM", (("n0", tuple(range(8))),)), 0)
    state.finish(done, 2 * h)  # ran half its estimate: estimates are read as halved
    state.submit(Job("a", num_gpus=4, estimate=10 * h, submit_time=2 * h))
    state.submit(Job("b", num_gpus=2))  # no estimate: the state's default (1 h)
    assert backlog(state, 2 * h) == (4 * 10 * h + 2 * h) * 0.5 / 8


def test_tiresias_demotes_long_running_jobs() -> None:
    state = cluster(1)
    state.start(state.submit(Job("long", num_gpus=8)),
                Allocation("H100-SXM", (("n0", tuple(range(8))),)), 0)  # fmt: skip
    state.submit(Job("new", num_gpus=8, submit_time=4 * 3600))
    d = _run(state, "tiresias", now=4 * 3600)  # long attained 32 GPU-h: a lower queue
    assert [j.id for j in d.preemptions] == ["long"] and _started(d) == ["new"]


def test_one_of_several_gpu_types_spills_to_the_next_pool() -> None:
    state = ClusterState()
    from gpucloud.scheduler import Node

    state.add_node(Node("h", "H100-SXM", 8))
    state.add_node(Node("a", "Ascend-910B", 8))
    state.start(state.submit(Job("busy", num_gpus=8)),
                Allocation("H100-SXM", (("h", tuple(range(8))),)), 0)  # fmt: skip
    state.submit(Job("any", num_gpus=4, gpu_types=("H100-SXM", "910B")))
    state.submit(Job("only", num_gpus=4, gpu_types=("H100-SXM",)))
    d = _run(state, "kueue")
    assert [(j.id, a.gpu_type) for j, a in d.starts] == [("any", "Ascend-910B")]


def test_an_explaining_pass_says_why_each_job_it_looked_at_waits() -> None:
    state = ClusterState()
    state.add_node(Node("n0", "L4", 4, cpu_milli=2000))
    state.add_tenant(Tenant("capped", quota={"L4": 1}, borrow=False))
    on = Allocation("L4", (("n0", (0,)),))
    state.start(state.submit(Job("busy", num_gpus=1, estimate=100, cpu_milli=1500)), on, 0)
    state.submit(Job("head", num_gpus=4, estimate=10, submit_time=1))  # 3 GPUs are free
    state.submit(Job("long", num_gpus=1, estimate=1000, submit_time=2))  # would delay head
    state.submit(Job("cpu", num_gpus=1, estimate=1, cpu_milli=1000, submit_time=3))
    state.submit(Job("over", tenant="capped", num_gpus=1, estimate=1, submit_time=4))
    state.submit(Job("later", tenant="capped", num_gpus=2, estimate=1, submit_time=5))
    policy = POLICIES["fifo"].with_(backfill="easy", quotas=True)
    state.start(state.get("over"), Allocation("L4", (("n0", (1,)),)), 0)  # capped is at 1
    d = Scheduler(policy, explain=True).schedule(state, 0)
    assert d.starts == [] and d.waiting == {
        "head": Wait.GPUS,
        "long": Wait.RESERVED,
        "cpu": Wait.HOST,  # 0.5 of its 1 CPU free on the only node
        "later": Wait.QUOTA,
    }
    assert Scheduler(policy).schedule(state, 0).waiting == {}  # the simulator's: no cost
