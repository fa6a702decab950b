"""EASY backfill: the first blocked job gets a reservation; later jobs may start only if
they cannot delay it.

The reservation is computed by GPU count in the pool where the blocked job could start
earliest: walking running jobs by estimated end (start + remaining estimate; an overrun
job is assumed to end now) until enough GPUs would be free. That time is the shadow time;
GPUs free then beyond the blocked job's need are the extra GPUs. A later job in that pool
may start if its estimated end is before the shadow time, or if it fits in the extra GPUs
(which it then uses up). Jobs in other pools are not affected.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpucloud.scheduler.state import MILLI, ClusterState, Job


@dataclass(slots=True)
class Reservation:
    job: Job
    gpu_type: str
    shadow_time: float
    extra: int

    def allows(self, state: ClusterState, job: Job, gpu_type: str, now: float) -> bool:
        if gpu_type != self.gpu_type:
            return True
        if now + job.remaining_estimate(state.default_estimate) <= self.shadow_time:
            return True
        return job.num_gpus <= self.extra

    def started(self, state: ClusterState, job: Job, gpu_type: str, now: float) -> None:
        """Account for a backfilled job that runs past the shadow time."""
        end = now + job.remaining_estimate(state.default_estimate)
        if gpu_type == self.gpu_type and end > self.shadow_time:
            self.extra -= job.num_gpus


def reserve(state: ClusterState, job: Job, gpu_types: list[str], now: float) -> Reservation | None:
    """The earliest reservation for `job` over `gpu_types`, or None if none can be made."""
    best: Reservation | None = None
    for t in gpu_types:
        free = state.pools[t].free_whole
        shadow = now
        for end, _, running in state.by_end[t]:
            if free >= job.num_gpus:
                break
            if running.gpu_milli == MILLI:
                free += running.num_gpus
            shadow = max(end, now)
        if free < job.num_gpus:
            continue
        if best is None or shadow < best.shadow_time:
            best = Reservation(job, t, shadow, free - job.num_gpus)
    return best
