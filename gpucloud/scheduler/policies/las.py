"""Tiresias-style discretized two-dimensional least attained service (2D-LAS).

A job's attained service is GPUs x seconds run so far (both dimensions of Tiresias),
which needs no duration knowledge. `thresholds` (GPU-seconds) split jobs into queues:
queue 0 holds jobs that received less than thresholds[0], and so on. Lower queues go
first; inside a queue, arrival order (Tiresias' FIFO inside a queue). A running job that
crosses a threshold is demoted, so a new job can preempt it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from gpucloud.scheduler.state import ClusterState, Job


@dataclass(frozen=True, slots=True)
class Las:
    thresholds: tuple[float, ...] = (3200.0 * 8, 3600.0 * 8 * 8)
    name: str = "las"

    def level(self, attained: float) -> int:
        return bisect.bisect_right(self.thresholds, attained)

    def order(self, state: ClusterState, now: float) -> Iterable[Job]:
        return state.queue(("las", self.thresholds), lambda j: (self.level(j.attained),))

    def rank(self, job: Job, now: float) -> tuple:
        return (self.level(job.attained_at(now)),)
