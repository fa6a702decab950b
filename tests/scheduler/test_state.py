from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpucloud.errors import CapacityError, ConfigError, NotFoundError, UserError
from gpucloud.scheduler import TRANSITIONS, Allocation, ClusterState, Job, JobState, Node, Tenant
from gpucloud.scheduler.placement import place
from gpucloud.scheduler.state import SortedQueue
from scheduler.helpers import check_invariants, cluster


def test_lifecycle_follows_the_transition_table() -> None:
    state = cluster(1)
    job = state.submit(Job("a", num_gpus=2, checkpoint_interval=100))
    state.start(job, Allocation("H100-SXM", (("n0", (0, 1)),)), now=0)
    assert job.state is JobState.RUNNING and state.pools["H100-SXM"].free_whole == 6
    lost = state.preempt(job, now=250)  # checkpoint at 200: 50 s x 2 GPUs lost
    assert lost == 100 and job.progress == 200 and job.state is JobState.PENDING
    assert job.attained == 500
    check_invariants(state)
    with pytest.raises(UserError, match="cannot go from pending to succeeded"):
        state.finish(job, now=300)
    assert JobState.SUCCEEDED in TRANSITIONS[JobState.RUNNING]
    assert not TRANSITIONS[JobState.SUCCEEDED]


def test_starting_on_a_busy_gpu_is_refused() -> None:
    state = cluster(1)
    a, b = state.submit(Job("a")), state.submit(Job("b"))
    state.start(a, Allocation("H100-SXM", (("n0", (3,)),)), 0)
    with pytest.raises(CapacityError, match="GPU 3 of n0 is not free"):
        state.start(b, Allocation("H100-SXM", (("n0", (3,)),)), 0)


def test_fractional_gpus_share_and_free_index_stays_exact() -> None:
    state = cluster(1, gpus=2)
    jobs = [state.submit(Job(f"f{i}", gpu_milli=m)) for i, m in enumerate((600, 400, 300))]
    state.start(jobs[0], Allocation("H100-SXM", (("n0", (0,)),), 600), 0)
    state.start(jobs[1], Allocation("H100-SXM", (("n0", (0,)),), 400), 0)
    state.start(jobs[2], Allocation("H100-SXM", (("n0", (1,)),), 300), 0)
    assert state.nodes["n0"].free_milli == [0, 700]
    assert state.pools["H100-SXM"].shared == [(700, 0, 1)]
    check_invariants(state)


def test_bad_input_says_what_is_allowed() -> None:
    with pytest.raises(UserError, match="fractional GPU request must ask for 1 GPU"):
        Job("x", num_gpus=2, gpu_milli=500)
    with pytest.raises(UserError, match="duration must be >= 0"):
        Job("x", duration=-1)
    with pytest.raises(ConfigError, match="do not split into link domains of 3"):
        Node("n", "A100", 8, 3)
    with pytest.raises(UserError, match="unknown GPU type 'H200X'"):
        Tenant("t", quota={"H200X": 8})
    state = cluster(1)
    with pytest.raises(CapacityError, match="largest pool it may use has 8"):
        state.submit(Job("big", num_gpus=9))


def test_a_cordoned_node_keeps_its_jobs_and_takes_no_new_work() -> None:
    state = cluster(2, gpus=4)
    running = state.submit(Job("r", num_gpus=2))
    state.start(running, Allocation("H100-SXM", (("n0", (0, 1)),)), 0)
    state.cordon("n0")
    check_invariants(state)
    assert state.free_gpus("H100-SXM") == 4  # only n1's
    assert place(state, Job("j", num_gpus=4), "H100-SXM").nodes == ("n1",)
    assert place(state, Job("k", num_gpus=5), "H100-SXM") is None
    state.finish(running, 10)  # its GPUs stay out of the pool while cordoned
    check_invariants(state)
    assert state.free_gpus("H100-SXM") == 4
    state.uncordon("n0")
    check_invariants(state)
    assert state.free_gpus("H100-SXM") == 8
    assert len(place(state, Job("k", num_gpus=5), "H100-SXM").parts) == 2
    with pytest.raises(NotFoundError, match="unknown node 'n9': did you mean"):
        state.cordon("n9")


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from(("a", "b", "c")), st.integers(0, 2)),
        max_size=60,
    )
)
def test_a_queue_built_at_once_orders_as_one_built_job_by_job(specs) -> None:
    """SortedQueue sorts the jobs it starts with in one go: the order must be the one that
    adding them one by one gives (ties on the key broken by arrival), per group too."""
    state = ClusterState()
    state.add_node(Node("n0", "H100-SXM", 8))
    for i, (priority, tenant, gpus) in enumerate(specs):
        state.submit(Job(f"j{i}", tenant=tenant, num_gpus=1 + gpus, priority=priority))

    def key(job: Job) -> tuple:
        return (-job.priority, job.num_gpus)

    def tenant(job: Job) -> str:
        return job.tenant

    at_once = SortedQueue(key, state.pending.values(), tenant)
    one_by_one = SortedQueue(key, (), tenant)
    for job in state.pending.values():
        one_by_one.add(job)
    assert [j.id for j in at_once] == [j.id for j in one_by_one]
    assert at_once.groups.keys() == one_by_one.groups.keys()
    for name, entries in at_once.groups.items():
        assert [e[-1].id for e in entries] == [e[-1].id for e in one_by_one.groups[name]]


def test_an_updated_job_keeps_its_arrival_and_moves_in_its_queues():
    """`update` changes a pending job's estimate in place: a queue keyed by the estimate
    (SJF's) re-sorts it, the arrival order (seq, FIFO's queue) does not change."""
    state = ClusterState()
    state.add_node(Node("n", "A100", 8))
    long, short = (state.submit(Job(n, estimate=e)) for n, e in (("long", 600.0), ("short", 60.0)))
    by_estimate = state.queue("sjf", lambda j: (j.estimate,))
    assert [j.id for j in by_estimate] == ["short", "long"]
    seq = long.seq
    state.update(long, 10.0, frozenset({"n"}))
    assert [j.id for j in by_estimate] == ["long", "short"]
    assert (long.seq, long.avoid_nodes) == (seq, frozenset({"n"}))
    assert [j.id for j in state.queue("fifo", lambda j: ())] == ["long", "short"]
    state.start(short, Allocation("A100-80GB", (("n", (0,)),)), 0.0)
    with pytest.raises(UserError, match="only a pending job"):
        state.update(short, 1.0, frozenset())


def test_a_forgotten_job_frees_its_gpus_and_its_id_but_stays_an_arrival():
    state = ClusterState()
    state.add_node(Node("n", "A100", 8))
    job = state.submit(Job("j", num_gpus=4))
    state.start(job, Allocation("A100-80GB", (("n", (0, 1, 2, 3)),)), 0.0)
    state.forget(job, 5.0)
    assert state.free_gpus("A100-80GB") == 8 and "j" not in state.jobs
    assert job.state is JobState.CANCELLED and state.arrived == [job]
    again = state.submit(Job("j", num_gpus=4))  # the same id, a new arrival
    assert again.seq == 1 and state.arrived == [job, again]
