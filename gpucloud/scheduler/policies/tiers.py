"""Estimate tiers: jobs are put in a few queues by their estimated remaining GPU-time
(`bounds`, in GPU-seconds); lower tiers go first, arrival order inside a tier.

Like Tiresias' discretized queues, but placed by the user's estimate instead of attained
service, so a short job is favoured from its first second and no job is preempted just
for having run long. Coarse tiers need only a rough estimate: an estimate off by 3x
usually lands in the right tier. A job without an estimate counts as `default_estimate`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from gpucloud.scheduler.state import ClusterState, Job


@dataclass(frozen=True, slots=True)
class Tiers:
    bounds: tuple[float, ...] = (16 * 3600.0,)
    default_estimate: float = 3600.0
    name: str = "tiers"

    def level(self, job: Job) -> int:
        return bisect.bisect_right(
            self.bounds, job.remaining_estimate(self.default_estimate) * job.gpus
        )

    def order(self, state: ClusterState, now: float) -> Iterable[Job]:
        return state.queue(("tiers", self.bounds), lambda j: (self.level(j),))

    def rank(self, job: Job, now: float) -> tuple:
        return (self.level(job),)
