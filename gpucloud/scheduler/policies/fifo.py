"""First in, first out: arrival order. A preempted job goes back to its original place."""

from __future__ import annotations

from collections.abc import Iterable

from gpucloud.scheduler.state import ClusterState, Job


class Fifo:
    name = "fifo"

    def order(self, state: ClusterState, now: float) -> Iterable[Job]:
        return state.queue("fifo", Fifo.key)

    def rank(self, job: Job, now: float) -> tuple:
        return (job.seq,)

    @staticmethod
    def key(job: Job) -> tuple:
        return ()
