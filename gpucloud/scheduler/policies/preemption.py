"""Victim selection: free enough GPUs of one pool for a blocked job by stopping
preemptible running jobs that `eligible` allows (lower rank, or a tenant over its quota).

Youngest victims first (they lose the least work; ties in start time: the last started
first), then victims that turn out not to be needed are dropped, smallest first, so the
set stays small. When jobs must fit in one node
(`per_node`), the node needing the fewest victims wins.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gpucloud.scheduler.state import MILLI, ClusterState, Job


def choose_victims(
    state: ClusterState,
    job: Job,
    gpu_type: str,
    eligible: Callable[[Job], bool],
    per_node: bool = False,
    among: list[Job] | None = None,
) -> list[Job] | None:
    """Running jobs whose preemption lets `job` start in `gpu_type`, or None.

    `among`: the only running jobs that may be victims, youngest first (default: all)."""

    def ok(r: Job) -> bool:
        alloc = r.allocation
        return (
            alloc is not None
            and alloc.gpu_type == gpu_type
            and r.preemptible
            and alloc.milli == MILLI
            and eligible(r)
        )

    if not per_node:
        # state.running is in start order: walking it backwards meets the youngest first
        # and stops as soon as enough GPUs would be free.
        running = reversed(state.running.values()) if among is None else among
        youngest = (r for r in running if ok(r))
        return _enough(youngest, job.num_gpus - state.pools[gpu_type].free_whole, _size)
    cands = [r for r in (reversed(state.running.values()) if among is None else among) if ok(r)]
    best: list[Job] | None = None
    for name in dict.fromkeys(n for r in cands for n in r.allocation.nodes):  # type: ignore[union-attr]
        node = state.nodes[name]
        if node.num_gpus < job.num_gpus:
            continue
        on_node = [r for r in cands if name in r.allocation.nodes]  # type: ignore[union-attr]
        need = job.num_gpus - node.free_whole
        chosen = _enough(on_node, need, lambda r, name=name: _gpus_on(r, name))
        if chosen is not None and (best is None or len(chosen) < len(best)):
            best = chosen
    return best


def _gpus_on(job: Job, node: str) -> int:
    assert job.allocation is not None
    return sum(len(g) for n, g in job.allocation.parts if n == node)


def _size(job: Job) -> int:
    return job.num_gpus


def _enough(cands: Iterable[Job], need: int, frees: Callable[[Job], int]) -> list[Job] | None:
    if need <= 0:
        return []
    chosen: list[Job] = []
    freed = 0
    for r in cands:
        chosen.append(r)
        freed += frees(r)
        if freed >= need:
            break
    else:
        return None
    for r in sorted(chosen, key=frees):
        if freed - frees(r) >= need:
            chosen.remove(r)
            freed -= frees(r)
    return chosen
