"""GPU fragmentation as the FGD paper defines it, and FGD placement (Weng et al., ATC'23,
"Beware of Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation Gradient
Descent").

A node's fragmentation is measured against a target workload, a mix of task classes
(GPUs asked for, share of each GPU, CPU and memory) weighted by how often each occurs. For
one class, the free GPU share on a node that the class cannot use is fragmented: all of it
if the node lacks the CPU or memory the task asks for; else the free share of every GPU
with less room than a fractional task asks for; for a task of n whole GPUs, every partly
used GPU's free share, or all of the node's free share if it lacks n free GPUs. FGD places
each task where the node's fragmentation grows least (the gradient).

Everything is in integer units (milli-GPU x class count), so equal moves compare equal and
placement stays deterministic; the per-node figures depend only on a node's free
resources, so `Workload` caches them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpucloud.errors import ConfigError
from gpucloud.scheduler.state import MILLI, ClusterState, Job, Node, Pool

# A node's free resources: the free share of each GPU (milli-GPU), free CPU (milli-cores)
# and free memory (MiB); -1 where the node does not track CPU or memory (never short).
Free = tuple[tuple[int, ...], int, int]
# A task class: (GPUs, milli-GPU of each, CPU milli-cores, memory MiB).
Task = tuple[int, int, int, int]
_CACHE = 1 << 16  # node states remembered per workload; the caches restart when full


def task(job: Job) -> Task:
    """The class of `job` in a workload mix."""
    return job.num_gpus, job.gpu_milli, job.cpu_milli, job.memory_mib


@dataclass(frozen=True, slots=True)
class Workload:
    """The target workload: `classes` of (num_gpus, gpu_milli, cpu_milli, memory_mib,
    count), sorted."""

    classes: tuple[tuple[int, int, int, int, int], ...]
    total: int = field(init=False, compare=False)
    _node: dict[Free, int] = field(default_factory=dict, init=False, compare=False, repr=False)
    _move: dict[tuple[Free, Task], tuple[int, int] | None] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        if not self.classes or any(c <= 0 for *_, c in self.classes):
            raise ConfigError("an FGD workload needs at least one task class with a count >= 1")
        object.__setattr__(self, "total", sum(c for *_, c in self.classes))

    @classmethod
    def of(cls, requests: Iterable[tuple[int, ...]]) -> Workload:
        """The mix of `(num_gpus, gpu_milli[, cpu_milli, memory_mib])` requests, each class
        weighted by its count."""
        return cls.from_counts(Counter(requests))

    @classmethod
    def from_counts(cls, counts: Mapping[tuple[int, ...], int]) -> Workload:
        merged: Counter = Counter()
        for request, c in counts.items():
            merged[(*request, 0, 0)[:4]] += c
        return cls(tuple(sorted((*t, c) for t, c in merged.items())))

    def units(self, free: Free) -> int:
        """Fragmentation of a node with these free shares, in milli-GPU x class count."""
        got = self._node.get(free)
        if got is None:
            if len(self._node) >= _CACHE:
                self._node.clear()
            got = self._node[free] = _node_units(free, self.classes)
        return got

    def gpus(self, units: float) -> float:
        """Units (as `units` returns) to expected fragmented GPUs."""
        return units / (self.total * MILLI)

    def move(self, free: Free, t: Task) -> tuple[int, int] | None:
        """The fragmentation increase of placing a task of class `t` on a node with
        `free`, and the GPU for a fractional task (-1 for whole GPUs); None if it does not
        fit."""
        key = (free, t)
        if key not in self._move:
            if len(self._move) >= _CACHE:
                self._move.clear()
            self._move[key] = self._best_move(free, t)
        return self._move[key]

    def _best_move(self, free: Free, t: Task) -> tuple[int, int] | None:
        shares, cpu, memory = free
        num, milli, want_cpu, want_memory = t
        if not _hosts(cpu, memory, want_cpu, want_memory):
            return None
        cpu_left = cpu - want_cpu if cpu >= 0 else cpu
        memory_left = memory - want_memory if memory >= 0 else memory
        before = self.units(free)
        if milli >= MILLI:
            if shares.count(MILLI) < num:
                return None
            left = sorted(shares)
            for i in range(len(left) - num, len(left)):
                left[i] = 0
            return self.units((tuple(sorted(left)), cpu_left, memory_left)) - before, -1
        best: tuple[int, int, int] | None = None  # (increase, free share, GPU)
        for g, f in enumerate(shares):
            if f >= milli:
                after = tuple(sorted((*shares[:g], f - milli, *shares[g + 1 :])))
                cand = (self.units((after, cpu_left, memory_left)) - before, f, g)
                if best is None or cand < best:
                    best = cand
        return None if best is None else (best[0], best[2])


def _hosts(cpu: int, memory: int, want_cpu: int, want_memory: int) -> bool:
    return (cpu < 0 or want_cpu <= cpu) and (memory < 0 or want_memory <= memory)


def _node_units(free: Free, classes: tuple[tuple[int, int, int, int, int], ...]) -> int:
    shares, cpu, memory = free
    node_free = sum(shares)
    partial = sum(f for f in shares if f < MILLI)
    whole = shares.count(MILLI)
    total = 0
    for num, milli, want_cpu, want_memory, count in classes:
        if not _hosts(cpu, memory, want_cpu, want_memory):
            frag = node_free
        elif milli < MILLI:
            frag = sum(f for f in shares if f < milli)
        else:
            frag = node_free if whole < num else partial
        total += count * frag
    return total


def fgd_fragmentation(state: ClusterState, workload: Workload) -> float:
    """Expected fragmented GPUs of the whole cluster against `workload` (cordoned nodes
    included: their free share is fragmented for every class that does not fit)."""
    return workload.gpus(sum(workload.units(_free(n)) for n in state.node_list))


def choose(
    state: ClusterState, pool: Pool, job: Job, workload: Workload, avoid: int | None = None
) -> tuple[Node, int] | None:
    """The node of `pool` (and for a fractional task, the GPU; else -1) where `job`, which
    fits in one node, grows fragmentation least, or None if it fits nowhere. The node with
    index `avoid` is left alone.

    Ties go to the node with less free share (packing), then the lower node index.
    """
    t = task(job)
    best: tuple[int, int, int, int] | None = None  # (increase, free, node index, GPU)
    low = 0 if job.gpu_milli < MILLI else job.num_gpus  # fewer free whole GPUs: no room
    for bucket in pool.buckets[low:]:
        for idx in bucket:
            if idx == avoid or state.node_list[idx].name in job.avoid_nodes:
                continue
            free = _free(state.node_list[idx])
            m = workload.move(free, t)
            if m is not None:
                cand = (m[0], sum(free[0]), idx, m[1])
                if best is None or cand < best:
                    best = cand
    return None if best is None else (state.node_list[best[2]], best[3])


def _free(node: Node) -> Free:
    return (
        tuple(node.free_milli),
        node.free_cpu if node.cpu_milli else -1,
        node.free_memory if node.memory_mib else -1,
    )
