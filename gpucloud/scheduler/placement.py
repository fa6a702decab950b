"""Where a gang goes: which nodes and which GPU indices, read from the pool indexes.

Rules, in order (see docs/simulator.md for the exact semantics):
- A gang never mixes GPU types; it may span nodes of its pool.
- A job that fits in one node goes on one node: `pack` picks the node with the fewest free
  GPUs that still fit it (best fit), `spread` the one with the most. Inside the node it
  prefers one NVLink/HCCS domain (best-fit domain), else the domains with the most room.
- With `consolidate` off, a job that fits in no single node spans the fewest racks (the
  racks with the most free GPUs, the last one best-fit), and inside them the fewest nodes:
  whole free nodes first, the remainder on a best-fit node. With `consolidate` on, only
  jobs larger than a node may span nodes.
- Cordoned nodes are never chosen (they are in no free index), nor the nodes a job avoids
  (`Job.avoid_nodes`: a training job restarted without its straggling node).
- A fractional request (gpu_milli < 1000) goes to the shared GPU with the least free
  share that still fits it, else to a whole free GPU on a best-fit node.
- `fgd` places a request that fits in one node where the FGD fragmentation of its
  `workload` grows least (gpucloud/scheduler/fgd.py); larger ones as `pack` does.
- A job that asks for CPU or memory only goes where a node has them for its GPUs there
  (`Node.hosts`); the rules above then choose among those nodes.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Literal

from gpucloud.errors import ConfigError
from gpucloud.scheduler import fgd
from gpucloud.scheduler.state import MILLI, Allocation, ClusterState, Job, Node, Pool

# How many candidate nodes of the best-fit bucket are checked for a whole free link domain:
# enough to find one in a fragmented pool, bounded so a pass stays O(1) per job.
_DOMAIN_PROBE = 8


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    strategy: Literal["pack", "spread", "fgd"] = "pack"
    consolidate: bool = False
    workload: fgd.Workload | None = None  # fgd's target workload (the task class mix)

    def __post_init__(self) -> None:
        if self.strategy not in ("pack", "spread", "fgd"):
            raise ConfigError(f"placement strategy {self.strategy!r}: choose pack, spread or fgd")
        if self.strategy == "fgd" and self.workload is None:
            raise ConfigError("placement fgd needs a workload (the task class mix to place for)")


def fits(state: ClusterState, job: Job, gpu_type: str) -> bool:
    """Cheap necessary condition: enough free capacity of `gpu_type` by count."""
    pool = state.pools[gpu_type]
    if job.gpu_milli < MILLI:
        return pool.free_whole > 0 or bool(pool.shared) and pool.shared[-1][0] >= job.gpu_milli
    return pool.free_whole >= job.num_gpus


def place(
    state: ClusterState,
    job: Job,
    gpu_type: str,
    cfg: PlacementConfig = PlacementConfig(),
    avoid: int | None = None,
) -> Allocation | None:
    """GPUs of `gpu_type` that are free now and would hold `job`, or None. `avoid`: the
    index of a node to leave alone (one an EASY reservation holds)."""
    if not fits(state, job, gpu_type):
        return None
    pool = state.pools[gpu_type]
    if cfg.workload is not None and cfg.strategy == "fgd" and job.num_gpus <= pool.max_node:
        alloc = _place_fgd(state, pool, job, cfg.workload, avoid)
        if alloc is not None:
            return alloc
    if job.gpu_milli < MILLI:
        return _place_fraction(state, pool, job, avoid)
    g = job.num_gpus
    node = _single_node(state, pool, job, g, cfg.strategy, avoid) if g <= pool.max_node else None
    if node is not None:
        return Allocation(gpu_type, ((node.name, _pick_gpus(node, g)),))
    if cfg.consolidate and g <= pool.max_node:
        return None
    return _span(state, pool, job, avoid)


def _place_fgd(
    state: ClusterState, pool: Pool, job: Job, workload: fgd.Workload, avoid: int | None
) -> Allocation | None:
    pick = fgd.choose(state, pool, job, workload, avoid)
    if pick is None:
        return None
    node, gpu = pick
    gpus = (gpu,) if job.gpu_milli < MILLI else _pick_gpus(node, job.num_gpus)
    return Allocation(pool.gpu_type, ((node.name, gpus),), job.gpu_milli)


def _single_node(
    state: ClusterState, pool: Pool, job: Job, g: int, strategy: str, avoid: int | None = None
) -> Node | None:
    """The node for `g` of `job`'s GPUs: the best-fit (pack) or emptiest (spread) bucket
    with a node that hosts it, preferring a node with a free link domain for it."""
    ks = range(g, pool.max_node + 1)
    for k in ks if strategy == "pack" else reversed(ks):
        bucket = pool.buckets[k]
        if not bucket or len(bucket) == 1 and avoid in bucket:
            continue
        first: Node | None = None
        probed = 0
        for idx in bucket:
            node = state.node_list[idx]
            if idx == avoid or not node.hosts(job, g):
                continue
            if first is None:
                first = node
            if g > node.domain_size or _domain_fit(node, g) is not None:
                return node
            probed += 1
            if probed >= _DOMAIN_PROBE:
                break
        if first is not None:
            return first
    return None


def _free_by_domain(node: Node) -> list[list[int]]:
    d = node.domain_size
    return [
        [i for i in range(s, s + d) if node.free_milli[i] == MILLI]
        for s in range(0, node.num_gpus, d)
    ]


def _domain_fit(node: Node, g: int) -> list[int] | None:
    """The free GPUs of the fullest link domain that still has `g` free, if any."""
    best = None
    for free in _free_by_domain(node):
        if len(free) >= g and (best is None or len(free) < len(best)):
            best = free
    return best[:g] if best is not None else None


def _pick_gpus(node: Node, g: int) -> tuple[int, ...]:
    inside = _domain_fit(node, g) if g <= node.domain_size else None
    if inside is not None:
        return tuple(inside)
    chosen: list[int] = []
    for free in sorted(_free_by_domain(node), key=len, reverse=True):
        chosen.extend(free[: g - len(chosen)])
        if len(chosen) == g:
            break
    return tuple(sorted(chosen))


def _span(state: ClusterState, pool: Pool, job: Job, avoid: int | None = None) -> Allocation | None:
    """Fewest racks, then fewest nodes inside them: the emptiest nodes whole, then a
    best-fit node for the remainder. Nodes that cannot host their part are passed over."""
    g = job.num_gpus
    free = pool.racks
    skipped = [state.node_list[avoid]] if avoid is not None else []
    skipped += [state.nodes[n] for n in job.avoid_nodes if n in state.nodes]
    for node in skipped:
        if node.gpu_type == pool.gpu_type:
            free = {**free, node.rack: free[node.rack] - node.free_whole}
    racks = _fewest_racks(free, g)
    if racks is None:
        return None
    parts: list[tuple[str, tuple[int, ...]]] = []
    used = {i for b in pool.buckets[1:] for i in b if state.node_list[i].rack not in racks}
    if avoid is not None:
        used.add(avoid)
    need = g
    k = pool.max_node
    while need > 0:
        rest = _best_fit_excluding(state, pool, job, need, used) if need <= pool.max_node else None
        if rest is not None:
            parts.append((rest.name, _pick_gpus(rest, need)))
            break
        while k > 0 and all(i in used for i in pool.buckets[k]):
            k -= 1
        if k == 0:
            return None
        idx = next(i for i in pool.buckets[k] if i not in used)
        used.add(idx)
        node = state.node_list[idx]
        take = min(k, need)
        if node.hosts(job, take):
            parts.append((node.name, _pick_gpus(node, take)))
            need -= take
    return Allocation(pool.gpu_type, tuple(parts))


def _fewest_racks(free: dict[str, int], g: int) -> set[str] | None:
    """The racks a gang of `g` GPUs spans, given free GPUs per rack: the fewest that hold
    it (the fullest racks first, the last one best-fit), or None if they lack `g`."""
    by_free = sorted((r for r, f in free.items() if f > 0), key=lambda r: -free[r])
    chosen: set[str] = set()
    need = g
    for i, rack in enumerate(by_free):
        fit = [r for r in by_free[i:] if free[r] >= need]
        if fit:
            chosen.add(min(fit, key=lambda r: free[r]))
            return chosen
        chosen.add(rack)
        need -= free[rack]
    return None


def _best_fit_excluding(
    state: ClusterState, pool: Pool, job: Job, g: int, used: set[int]
) -> Node | None:
    for k in range(g, pool.max_node + 1):
        for idx in pool.buckets[k]:
            if idx not in used and state.node_list[idx].hosts(job, g):
                return state.node_list[idx]
    return None


def _place_fraction(
    state: ClusterState, pool: Pool, job: Job, avoid: int | None = None
) -> Allocation | None:
    milli = job.gpu_milli
    i = bisect.bisect_left(pool.shared, (milli, -1, -1))
    for _, idx, gpu in itertools.islice(pool.shared, i, None):
        node = state.node_list[idx]
        if idx != avoid and node.hosts(job, 1):
            return Allocation(pool.gpu_type, ((node.name, (gpu,)),), milli)
    node = _single_node(state, pool, job, 1, "pack", avoid)
    if node is None:
        return None
    return Allocation(pool.gpu_type, ((node.name, _pick_gpus(node, 1)),), milli)
