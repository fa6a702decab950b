from __future__ import annotations

import pytest

from gpucloud.errors import CapacityError, ConfigError, UserError
from gpucloud.scheduler import TRANSITIONS, Allocation, Job, JobState, Node, Tenant
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
