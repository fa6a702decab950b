from __future__ import annotations

from gpucloud.scheduler import POLICIES, Allocation, Job
from gpucloud.scheduler.projection import project_starts
from scheduler.helpers import cluster

FIFO = POLICIES["fifo"]


def _running(state, job: Job, gpus: tuple[int, ...], started: float) -> None:
    state.start(state.submit(job), Allocation("H100-SXM", (("n0", gpus),)), started)


def test_pending_jobs_start_as_the_running_ones_end_by_their_estimates() -> None:
    state = cluster(1, gpus=4)
    _running(state, Job("a", num_gpus=2, estimate=600), (0, 1), started=0)
    _running(state, Job("b", num_gpus=2, estimate=1200), (2, 3), started=100)
    state.submit(Job("first", num_gpus=2, estimate=300, submit_time=10))
    state.submit(Job("second", num_gpus=4, estimate=60, submit_time=20))
    state.submit(Job("third", num_gpus=2, submit_time=30))  # no estimate of its own
    starts = project_starts(state, FIFO, now=200).starts
    # a ends at 600 (first takes its GPUs, until 900); b at 1300; second needs all four
    # and then third follows it at 1360: its own missing estimate does not matter.
    assert starts == {"first": 600, "second": 1300, "third": 1360}


def test_a_job_past_its_estimate_is_taken_to_end_now() -> None:
    state = cluster(1, gpus=2)
    _running(state, Job("late", num_gpus=2, estimate=100), (0, 1), started=0)
    state.submit(Job("next", num_gpus=2, estimate=50))
    assert project_starts(state, FIFO, now=500).starts == {"next": 500}


def test_a_start_behind_a_running_job_without_an_estimate_is_unknown() -> None:
    state = cluster(1, gpus=4)
    _running(state, Job("known", num_gpus=2, estimate=600), (0, 1), started=0)
    _running(state, Job("open-ended", num_gpus=2), (2, 3), started=0)  # no estimate
    state.submit(Job("fits-after-known", num_gpus=2, estimate=60, submit_time=1))
    state.submit(Job("needs-all", num_gpus=4, estimate=60, submit_time=2))
    projection = project_starts(state, FIFO, now=10)
    assert projection.starts == {"fits-after-known": 600, "needs-all": None}
    assert projection.horizon is None  # it waits on an end no estimate tells


def test_a_start_past_the_last_pass_is_unknown() -> None:
    state = cluster(1, gpus=1)
    for i in range(5):
        state.submit(Job(f"j{i}", estimate=100, submit_time=i))
    projection = project_starts(state, FIFO, now=0, max_passes=3)
    assert projection.starts == {"j0": 0, "j1": 100, "j2": 200, "j3": None, "j4": None}
    assert projection.horizon == 300  # j3 and j4 start later than that
