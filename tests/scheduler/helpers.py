"""Helpers shared by the scheduler tests: small clusters, an invariant check, and the
starvation-backlog policy that the guard tests exercise."""

from __future__ import annotations

import math

from gpucloud.scheduler import MILLI, ClusterState, JobState, Node, Policy
from gpucloud.scheduler.policies.tiers import Tiers

# The `gpucloud` preset before issue 18's fourth round: GPU-time tiers (a job without an
# estimate in the long tier), a job starves once it has waited the current backlog.
BACKLOG = Policy(
    "backlog",
    Tiers((16 * 3600.0,), default_estimate=math.inf),
    backfill="easy",
    quotas=True,
    reclaim=True,
    starvation_backlog=1.0,
)


def cluster(nodes: int = 2, gpus: int = 8, gpu: str = "H100-SXM", domain: int = 0) -> ClusterState:
    state = ClusterState()
    for i in range(nodes):
        state.add_node(Node(f"n{i}", gpu, gpus, domain, f"rack-{i // 2}"))
    return state


def check_invariants(state: ClusterState) -> None:
    """Recount everything from the allocations and compare with the incremental indexes."""
    used = {(n.name, g): 0 for n in state.node_list for g in range(n.num_gpus)}
    host = {n.name: [0, 0] for n in state.node_list}  # CPU and memory held on each node
    usage: dict[tuple[str, str], float] = {}
    for job in state.jobs.values():
        if job.state is JobState.RUNNING:
            a = job.allocation
            assert a is not None and a.num_gpus == job.num_gpus  # gang: all or nothing
            assert job.id not in state.pending
            assert len({(n, g) for n, gs in a.parts for g in gs}) == job.num_gpus
            for name, gs in a.parts:
                assert state.nodes[name].gpu_type == a.gpu_type
                for g in gs:
                    used[(name, g)] += a.milli
                cpu, memory = job.host_share(len(gs))
                host[name][0] += cpu
                host[name][1] += memory
            key = (job.tenant, a.gpu_type)
            usage[key] = usage.get(key, 0.0) + job.gpus
        else:
            assert job.allocation is None
            assert (job.id in state.pending) == (job.state is JobState.PENDING)
    for (name, g), milli in used.items():
        assert milli <= MILLI, f"GPU {g} of {name} is over-allocated"
        assert state.nodes[name].free_milli[g] == MILLI - milli
    for n in state.node_list:
        cpu, memory = host[n.name]
        assert (n.free_cpu, n.free_memory) == (n.cpu_milli - cpu, n.memory_mib - memory)
        assert not n.cpu_milli or n.free_cpu >= 0, f"{n.name}: CPU over-allocated"
        assert not n.memory_mib or n.free_memory >= 0, f"{n.name}: memory over-allocated"
    for t, pool in state.pools.items():
        nodes = [n for n in state.node_list if n.gpu_type == t and not n.cordoned]
        assert pool.free_whole == sum(n.free_whole for n in nodes)
        for k, bucket in enumerate(pool.buckets):
            assert sorted(bucket) == sorted(n.index for n in nodes if n.free_whole == k)
        for rack, free in pool.racks.items():
            assert free == sum(n.free_whole for n in nodes if n.rack == rack)
        shared = [
            (m, n.index, g) for n in nodes for g, m in enumerate(n.free_milli) if 0 < m < MILLI
        ]
        assert pool.shared == sorted(shared)
    for (tenant, t), g in usage.items():
        assert abs(state.usage[tenant].get(t, 0.0) - g) < 1e-9
