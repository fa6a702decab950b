"""When each pending job should start: the scheduler's own passes run forward in time.

Running jobs end at their estimated end (start + remaining estimate; one already past it
ends at once), and after each end the same `Scheduler.schedule` the live control plane
calls decides what starts. A job's projected start is the first pass that starts it.

The projection knows only what the estimates tell it. A running job without an estimate
has no known end: once the projection has to wait for one (nothing with a known end is
left to finish), every job still pending gets no start (None), as does a job still
pending after `max_passes` passes. Jobs submitted later, failures and early ends are not
foreseen: the answer is a forecast, not a promise.
"""

from __future__ import annotations

from gpucloud.scheduler.core import Scheduler
from gpucloud.scheduler.policies import Policy
from gpucloud.scheduler.state import ClusterState, Job

MAX_PASSES = 1000  # bounds the work of one projection (a pass per distinct end time)


def project_starts(
    state: ClusterState, policy: Policy, now: float, max_passes: int = MAX_PASSES
) -> dict[str, float | None]:
    """Each job pending in `state` at `now` -> its projected start (seconds on `now`'s
    clock), or None if the projection cannot tell. Consumes `state`: pass one built for
    the purpose (the control plane's `cluster.load` builds a new one each time)."""
    scheduler = Scheduler(policy)
    starts: dict[str, float | None] = dict.fromkeys(state.pending)
    waiting = set(starts)
    t = now
    for _ in range(max_passes):
        for job, _alloc in scheduler.schedule(state, t).starts:
            if job.id in waiting:
                starts[job.id] = t
                waiting.discard(job.id)
        ending = _next_known_ends(state, t)
        if not waiting or not ending:
            break
        t = ending[0][0]
        for _end, job in ending:
            state.finish(job, t)
    return starts


def _next_known_ends(state: ClusterState, now: float) -> list[tuple[float, Job]]:
    """The running jobs with an estimate that end first (all those ending at the same
    time), with that time; empty if no running job has an estimate."""
    ends = [
        (max(job.start_time + job.remaining_estimate(0.0), now), job)
        for job in state.running.values()
        if job.estimate is not None and job.start_time is not None
    ]
    if not ends:
        return []
    first = min(end for end, _ in ends)
    return [(end, job) for end, job in ends if end == first]
