"""The due-time guard: the virtual FIFO's due times, and what a due job may do."""

from __future__ import annotations

import heapq

import hypothesis.strategies as st
from hypothesis import given, settings

from gpucloud.scheduler import POLICIES, Allocation, Job, Scheduler
from gpucloud.scheduler.policies.due import VirtualFifo
from scheduler.helpers import BACKLOG, check_invariants, cluster

H = 3600.0


def _reference_fifo(jobs: list[tuple[float, int, float]], capacity: int) -> list[float]:
    """Strict FIFO over GPU counts, written as plainly as possible: start times."""
    starts: list[float] = []
    running: list[tuple[float, int]] = []
    free, clock = capacity, 0.0
    for submit, gpus, length in jobs:
        clock = max(clock, submit)
        while True:
            while running and running[0][0] <= clock:
                free += heapq.heappop(running)[1]
            if gpus <= free:
                break
            clock = running[0][0]
        starts.append(clock)
        free -= gpus
        heapq.heappush(running, (clock + length, gpus))
    return starts


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 5 * H), st.integers(1, 16), st.floats(60, 10 * H) | st.none()),
        min_size=1,
        max_size=30,
    ),
    st.lists(st.floats(0, 60 * H), min_size=1, max_size=5),
)
def test_virtual_fifo_matches_a_plain_fifo_however_often_it_advances(jobs, checks) -> None:
    state = cluster(2, 8)
    jobs = sorted(jobs, key=lambda j: j[0])
    for i, (submit, gpus, est) in enumerate(jobs):
        state.submit(Job(f"j{i}", num_gpus=gpus, estimate=est, submit_time=submit))
    v = VirtualFifo(state.capacity())
    for now in sorted(checks):
        ahead = v._peek(state, now)  # the look ahead of `due_lead` foresees the advance
        v.advance(state, now)
        assert v.frontier == ahead
    v.advance(state, 1e9)
    lengths = [(s, g, e if e is not None else state.default_estimate) for s, g, e in jobs]
    assert v.starts == _reference_fifo(lengths, 16)
    for now in sorted(checks):
        due = [v.due(j, now, 0.0) for j in state.arrived]
        assert due == sorted(due, reverse=True)  # a prefix of the arrival order


def test_a_real_job_ending_early_moves_its_virtual_twin() -> None:
    state = cluster(1, 8)
    a = state.submit(Job("a", num_gpus=8, estimate=10 * H))
    b = state.submit(Job("b", num_gpus=8, estimate=H, submit_time=10.0))
    v = VirtualFifo(state.capacity())
    state.start(a, Allocation("H100-SXM", (("n0", tuple(range(8))),)), 0.0)
    v.advance(state, H)
    assert not v.due(b, H, 0.0)  # a's estimate says it runs until 10 h
    state.finish(a, 2 * H)
    v.advance(state, 2 * H)
    assert v.due(b, 2 * H, 0.0)
    assert v.starts[b.seq] == 2 * H


def test_a_due_job_goes_before_shorter_ones_and_preempts_a_job_that_overtook_it() -> None:
    state = cluster(2, 8)
    sched = Scheduler(POLICIES["fsp"])
    a = state.submit(Job("a", num_gpus=8, estimate=H))
    b = state.submit(Job("b", num_gpus=8, estimate=H))
    sched.schedule(state, 0.0)
    x = state.submit(Job("x", num_gpus=16, estimate=5 * H, submit_time=10.0))
    y = state.submit(Job("y", num_gpus=8, estimate=0.25 * H, submit_time=20.0))
    sched.schedule(state, 20.0)
    state.finish(a, 1800.0)
    d = sched.schedule(state, 1800.0)
    # x is not due yet (the virtual FIFO starts it when b ends, at 1 h): shortest first
    assert [j.id for j, _ in d.starts] == ["y"]
    state.finish(b, H)
    d = sched.schedule(state, H)
    # x is due now; y, which overtook it, runs past its estimate and is not due itself
    assert d.preemptions == [y]
    assert [j.id for j, _ in d.starts] == ["x"]
    check_invariants(state)
    # once running, a due job is never a victim: a later short job waits
    state.submit(Job("z", num_gpus=8, estimate=60.0, submit_time=H + 1))
    d = sched.schedule(state, 3 * H)
    assert d.preemptions == [] and x.state.value == "running"


def test_plain_sjf_would_have_let_the_short_job_keep_overtaking() -> None:
    state = cluster(2, 8)
    sched = Scheduler(POLICIES["sjf"])
    a = state.submit(Job("a", num_gpus=8, estimate=H))
    b = state.submit(Job("b", num_gpus=8, estimate=H))
    sched.schedule(state, 0.0)
    state.submit(Job("x", num_gpus=16, estimate=5 * H, submit_time=10.0))
    state.submit(Job("y", num_gpus=8, estimate=0.25 * H, submit_time=20.0))
    state.finish(a, 1800.0)
    sched.schedule(state, 1800.0)
    state.finish(b, H)
    d = sched.schedule(state, H)
    assert d.preemptions == [] and d.starts == []


def test_under_guard_backfill_short_jobs_start_around_a_blocked_due_jobs_reservation() -> None:
    """`guard="backfill"`: a due job that cannot start yet holds an EASY reservation and a
    job that ends before it starts; the `fsp` preset lets nothing start behind it."""
    for guard, started in (("block", []), ("backfill", ["z"])):
        state = cluster(2, 8)
        sched = Scheduler(POLICIES["fsp"].with_(guard=guard, min_run=H))
        a = state.submit(Job("a", num_gpus=8, estimate=H))
        b = state.submit(Job("b", num_gpus=8, estimate=H))
        sched.schedule(state, 0.0)
        x = state.submit(Job("x", num_gpus=16, estimate=5 * H, submit_time=10.0))
        state.finish(b, 0.5 * H)
        state.submit(Job("y", num_gpus=8, estimate=H, submit_time=0.5 * H))
        assert [j.id for j, _ in sched.schedule(state, 0.5 * H).starts] == ["y"]  # x not due
        state.finish(a, H)
        state.submit(Job("z", num_gpus=8, estimate=0.25 * H, submit_time=H))
        d = sched.schedule(state, H)  # x is due; y runs until 1.5 h and is younger than min_run
        held = d.reservation and (d.reservation.job.id, d.reservation.shadow_time)
        assert held == (None if guard == "block" else ("x", 1.5 * H))
        assert [j.id for j, _ in d.starts] == started and x.state.value == "pending"
        check_invariants(state)


def test_with_a_lead_a_job_is_due_as_early_as_the_due_queue_ahead_of_it_takes_to_drain() -> None:
    state = cluster(2, 8)
    a = state.submit(Job("a", num_gpus=16, estimate=H))
    b = state.submit(Job("b", num_gpus=16, estimate=H, submit_time=10.0))
    c = state.submit(Job("c", num_gpus=16, estimate=H, submit_time=20.0))
    state.start(a, Allocation("H100-SXM", (("n0", tuple(range(8))), ("n1", tuple(range(8))))), 0)
    v = VirtualFifo(state.capacity())
    v.advance(state, H)  # a overruns its estimate: the virtual FIFO starts b at 1 h
    assert v.due(b, H, 0.0) and not v.due(c, H, 0.0)  # c's virtual start is 2 h
    v.run_ahead(state, H, 0.0, 0.0)
    # b, due, needs the whole cluster for 1 h: c becomes due 1 h before its virtual start
    assert v.lead == H and v.due(c, H, 0.0)
    assert v.starts == [0.0, H]  # the virtual FIFO itself did not move ahead
    sched = Scheduler(POLICIES["fsp"].with_(due_lead=True, due_rebase=False))
    sched.schedule(state, H)
    assert sched._virtual is not None and sched._virtual.due(c, H, 0.0)


def test_the_virtual_fifos_longest_wait_counts_its_head_before_it_starts() -> None:
    state = cluster(1, 8)
    a = state.submit(Job("a", num_gpus=8, estimate=10 * H))
    state.submit(Job("b", num_gpus=8, estimate=H, submit_time=H))
    state.start(a, Allocation("H100-SXM", (("n0", tuple(range(8))),)), 0.0)
    v = VirtualFifo(state.capacity())
    v.advance(state, 5 * H)
    assert v.longest_wait(state, 5 * H) == 4 * H  # b, not started, has waited 4 h
    v.advance(state, 12 * H)
    assert v.max_wait == 9 * H and v.longest_wait(state, 12 * H) == 9 * H


def test_starvation_fifo_lets_a_long_job_go_first_once_it_waited_fifos_longest_wait() -> None:
    """A long-tier job starves once it has waited as long as the virtual FIFO's longest wait
    so far (here its own: 2 h); without the limit the short job overtakes it."""
    for limit, first in ((None, "s"), (1.0, "long")):
        state = cluster(1, 8)
        policy = BACKLOG.with_(starvation_backlog=None, starvation_fifo=limit)
        sched = Scheduler(policy)
        r = state.submit(Job("r", num_gpus=8, estimate=2 * H))
        sched.schedule(state, 0.0)
        state.submit(Job("long", num_gpus=8, estimate=20 * H, submit_time=1.0))
        state.submit(Job("s", num_gpus=8, estimate=H, submit_time=0.5 * H))
        state.finish(r, 2 * H)
        d = sched.schedule(state, 2 * H)
        assert [j.id for j, _ in d.starts] == [first]
        check_invariants(state)


def test_under_guard_arrival_a_due_job_preempts_any_job_that_arrived_after_it() -> None:
    """A later arrival running while an earlier job is due holds GPUs FIFO would have given
    that job first, even if it is due itself (here: running since before the due job could
    start, as when a backfilled job overruns its estimate). Only guard "arrival" takes them
    back; the others protect a job once it is due (or once it started when due)."""
    for guard, victims in (("preempt", []), ("backfill", []), ("arrival", ["x"])):
        state = cluster(1, 8)
        sched = Scheduler(POLICIES["fsp"].with_(guard=guard))
        y = state.submit(Job("y", num_gpus=8, estimate=H))
        x = state.submit(Job("x", num_gpus=4, estimate=H, submit_time=1.0))
        state.start(x, Allocation("H100-SXM", (("n0", (0, 1, 2, 3)),)), 1.0)
        d = sched.schedule(state, 2 * H)  # y is due since 0 h, x since 1 h (virtual FIFO)
        assert [j.id for j in d.preemptions] == victims
        assert (y.state.value == "running") == bool(victims)
        check_invariants(state)


def test_under_guard_arrival_a_due_job_never_preempts_a_job_that_arrived_before_it() -> None:
    state = cluster(1, 8)
    sched = Scheduler(POLICIES["fsp"].with_(guard="arrival", min_run=0.0))
    w = state.submit(Job("w", num_gpus=4, estimate=H))
    state.start(w, Allocation("H100-SXM", (("n0", (0, 1, 2, 3)),)), 0.0)
    z = state.submit(Job("z", num_gpus=8, estimate=H, submit_time=1.0))
    d = sched.schedule(state, 3 * H)  # w overran its estimate; z is due and blocked
    assert d.preemptions == [] and z.state.value == "pending"
    assert d.reservation is not None and d.reservation.job is z


def test_a_rebased_virtual_fifo_keeps_a_job_running_while_its_real_twin_runs_past_it() -> None:
    """Without re-basing the virtual FIFO ends a job at its estimate although the real job
    still runs, and runs ahead of the real cluster; re-based, the virtual run lasts twice
    the work the real job has done so far, until the real job ends."""
    for rebase, due_at_3h in ((False, True), (True, False)):
        state = cluster(1, 8)
        a = state.submit(Job("a", num_gpus=8, estimate=H))
        b = state.submit(Job("b", num_gpus=8, estimate=H, submit_time=10.0))
        state.start(a, Allocation("H100-SXM", (("n0", tuple(range(8))),)), 0.0)
        v = VirtualFifo(state.capacity(), rebase=rebase)
        v.advance(state, 3 * H)
        assert v.due(b, 3 * H, 0.0) == due_at_3h
        state.finish(a, 4 * H)
        v.advance(state, 4 * H)
        assert v.starts[b.seq] == (H if not rebase else 4 * H)
