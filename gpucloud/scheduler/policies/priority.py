"""Priority classes: higher `Job.priority` first, arrival order inside a class."""

from __future__ import annotations

from collections.abc import Iterable

from gpucloud.scheduler.state import ClusterState, Job


class Priority:
    name = "priority"

    def order(self, state: ClusterState, now: float) -> Iterable[Job]:
        return state.queue("priority", _key)

    def rank(self, job: Job, now: float) -> tuple:
        return (-job.priority,)


def _key(job: Job) -> tuple:
    return (-job.priority,)
