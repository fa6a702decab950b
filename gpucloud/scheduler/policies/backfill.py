"""EASY backfill: the first blocked job gets a reservation; later jobs may start only if
they cannot delay it.

The reservation is made in the pool where the blocked job could start earliest, walking
running jobs by estimated end (start + remaining estimate; an overrun job is assumed to
end now) until enough GPUs would be free; that time is the shadow time. GPUs that running
jobs hold on cordoned nodes never count: they are not coming back.

- A gang that may span nodes needs only a GPU count: the reservation is `extra`, the GPUs
  free at the shadow time beyond its need. A later job in that pool may start if its
  estimated end is before the shadow time, or if it fits in the extra GPUs (which it then
  uses up).
- A job that must sit on one node (placement `consolidate`, job no larger than a node)
  needs one node with enough free GPUs: the walk stops at the first node that would have
  them, and the reservation holds that node. A later job that would run past the shadow
  time may start anywhere but there.

Jobs in other pools are not affected.
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
    node: int | None = None  # index of the node held for a single-node job

    def allows(self, state: ClusterState, job: Job, gpu_type: str, now: float) -> bool:
        """Whether `job` may start in `gpu_type` anywhere (see `avoid` for the rest)."""
        if gpu_type != self.gpu_type:
            return True
        if now + job.remaining_estimate(state.default_estimate) <= self.shadow_time:
            return True
        return self.node is None and job.num_gpus <= self.extra

    def avoid(self, gpu_type: str) -> int | None:
        """The node a job that `allows` refused may still start off, or None if it may
        not start at all."""
        return self.node if gpu_type == self.gpu_type else None

    def started(self, state: ClusterState, job: Job, gpu_type: str, now: float) -> None:
        """Account for a backfilled job that runs past the shadow time."""
        end = now + job.remaining_estimate(state.default_estimate)
        if gpu_type == self.gpu_type and end > self.shadow_time and self.node is None:
            self.extra -= job.num_gpus


def reserve(
    state: ClusterState, job: Job, gpu_types: list[str], now: float, one_node: bool = False
) -> Reservation | None:
    """The earliest reservation for `job` over `gpu_types`, or None if none can be made.
    `one_node`: the job must run on a single node (placement `consolidate`)."""
    best: Reservation | None = None
    for t in gpu_types:
        pool = state.pools[t]
        if one_node and job.num_gpus <= pool.max_node:
            r = _reserve_node(state, job, t, now)
        else:
            r = _reserve_count(state, job, t, now)
        if r is not None and (best is None or r.shadow_time < best.shadow_time):
            best = r
    return best


def _reserve_count(state: ClusterState, job: Job, t: str, now: float) -> Reservation | None:
    free = state.pools[t].free_whole
    shadow = now
    for end, _, running in state.by_end[t]:
        if free >= job.num_gpus:
            break
        freed = _freed(state, running)
        if freed:
            free += sum(freed.values())
            shadow = max(end, now)
    if free < job.num_gpus:
        return None
    return Reservation(job, t, shadow, free - job.num_gpus)


def _reserve_node(state: ClusterState, job: Job, t: str, now: float) -> Reservation | None:
    pool = state.pools[t]
    g = job.num_gpus
    ready = next((i for k in range(g, pool.max_node + 1) for i in pool.buckets[k]), None)
    if ready is not None:
        return Reservation(job, t, now, 0, ready)
    free: dict[int, int] = {}
    for end, _, running in state.by_end[t]:
        for idx, n in _freed(state, running).items():
            if idx not in free:
                free[idx] = state.node_list[idx].free_whole
            free[idx] += n
            if free[idx] >= g:
                return Reservation(job, t, max(end, now), 0, idx)
    return None


def _freed(state: ClusterState, running: Job) -> dict[int, int]:
    """Whole GPUs per node index that `running` gives back to the pool when it ends."""
    alloc = running.allocation
    if alloc is None or running.gpu_milli != MILLI:
        return {}
    out: dict[int, int] = {}
    for name, gpus in alloc.parts:
        node = state.nodes[name]
        if not node.cordoned:
            out[node.index] = out.get(node.index, 0) + len(gpus)
    return out
