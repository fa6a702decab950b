"""Shortest job first by the user's estimate (or the true duration, for an oracle baseline).

The key is the remaining estimated work in GPU-seconds when `by_gpu_time`, else in seconds.
A job without an estimate counts as `default_estimate`.

With `aging` > 0 the key is length + aging x submit time: the same order as length minus
aging x time waited, so a waiting job gains `aging` seconds of priority per second and a
job can only be overtaken by jobs that arrive within length / aging of it. That bounds
starvation while keeping the key fixed while a job waits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpucloud.scheduler.state import ClusterState, Job


@dataclass(frozen=True, slots=True)
class Sjf:
    by_gpu_time: bool = False
    oracle: bool = False  # simulation only: sort by the true remaining duration
    default_estimate: float = 3600.0
    aging: float = 0.0

    @property
    def name(self) -> str:
        return ("sjf-oracle" if self.oracle else "sjf") + ("-gpu-time" if self.by_gpu_time else "")

    def length(self, job: Job) -> float:
        if self.oracle and job.duration is not None:
            rest = max(job.duration - job.progress, 0.0)
        else:
            rest = job.remaining_estimate(self.default_estimate)
        return rest * job.gpus if self.by_gpu_time else rest

    def order(self, state: ClusterState, now: float) -> Iterable[Job]:
        return state.queue(("sjf", self), lambda j: (self.rank(j, 0.0)[0],))

    def rank(self, job: Job, now: float) -> tuple:
        return (self.length(job) + self.aging * job.submit_time,)
