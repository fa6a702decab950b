"""Seconds of the collectives a training step adds, over the catalog's links.

Ring collectives as nccl-tests measures them: an all-reduce of B bytes over n ranks moves
2(n-1)/n·B through each rank, a reduce-scatter or an all-gather (n-1)/n·B, at the ring's
bus bandwidth, plus a hop's latency for each of the ring's n-1 steps. Inside one server
the bus bandwidth is the GPU's link one way (half the bidirectional figure vendors quote;
PCIe when the group spans more GPUs than share the fast link). Across servers each ring
crosses every server boundary once, so the NICs of a server together bound it
(`node_network_bandwidth`): 400 GB/s on an HGX H100 node, 6.25 GB/s on a server of
GeForce cards with two 25 GbE ports. They are shared by every ring leaving the server at
once: under tensor or pipeline parallelism a server's GPUs sit in different data-parallel
groups (`placement` says which), each syncing its gradients at the same time.

Data parallelism syncs the gradients once per optimizer step: DDP all-reduces them during
backward; ZeRO-1/2 reduce-scatter them during backward and all-gather the updated shards
after the step; ZeRO-3 (FSDP) also gathers each layer's parameters in every micro-batch's
forward and again in its backward. Buckets and prefetching overlap these with compute: the
backward's collectives with backward, ZeRO-3's forward gathers with forward, so only what
exceeds that compute is exposed. ZeRO-1/2's gather after the step and tensor
parallelism's all-reduces (between matmuls) are never hidden.

Expert parallelism (`ep`) changes both. The shared parameters sync over the whole
data-parallel group as above, each rank's experts only over their dp/ep replicas (under DDP
after backward, as train/expert_parallel.py reduces them; under FSDP2 as their own units).
Those replicas are every ep-th rank, so when ep fills a server they sit one per server and
share its NICs with the ep rings the other GPUs run at the same time. And each MoE layer
exchanges the routed tokens: an all-to-all dispatches each token's top-k hidden states to
the ranks holding their experts and another combines the outputs, in forward and again
(gradients) in backward, plus the forward's two once more under full recomputation. They
sit between the router and the experts, so compute hides none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpucloud.hardware import Accelerator
from gpucloud.models.spec import ModelSpec
from gpucloud.planner import placement
from gpucloud.planner.memory import stage_expert_params
from gpucloud.planner.setup import TrainSetup

PCIE_GEN4 = 64e9  # bytes/s bidirectional, x16: where a group leaves the fast-link domain
HOP_LATENCY_S = 10e-6  # one step of a ring: a hop's latency plus the library's overhead


@dataclass(frozen=True)
class StepComm:
    """Seconds per optimizer step, and the bytes each GPU sends, of each kind of collective."""

    data_parallel_bytes: float  # what each GPU moves for the gradient sync (and ZeRO-3's gathers)
    data_parallel_s: float  # those collectives at the rings' bus bandwidth, hidden or not
    all_to_all_bytes: float  # what each GPU sends to other ranks in expert all-to-alls
    all_to_all_s: float  # those all-to-alls, never hidden
    exposed_s: float  # what compute does not hide: tensor parallelism's and all-to-alls too


def bus_bandwidth(gpu: Accelerator, per_node: int, nodes: int, rings_per_node: int = 1) -> float:
    """Bytes/s a ring of `per_node` GPUs on each of `nodes` servers sustains per rank, while
    `rings_per_node` such rings cross the same servers' NICs at once."""
    link = gpu.link_bandwidth if per_node <= gpu.link_domain else min(gpu.link_bandwidth,
                                                                       PCIE_GEN4)  # fmt: skip
    intra = link / 2
    return intra if nodes == 1 else min(intra, gpu.node_network_bandwidth / rings_per_node)


@dataclass(frozen=True)
class _Ring:
    """A group that keeps some parameters in sync: its ranks and their ring's bandwidth."""

    ranks: int
    bandwidth: float


def step_comm(
    spec: ModelSpec, setup: TrainSetup, compute_s: float, forward_share: float
) -> StepComm:
    """The collectives of one optimizer step taking `compute_s` seconds of compute, of which
    `forward_share` is forward passes (the rest, backward and recomputation, can hide the
    gradients' reduction)."""
    everyone = _ring(setup, setup.dp, placement.data_parallel_groups(setup))
    phi = spec.num_params / (setup.tp * setup.pp)
    experts = (stage_expert_params(spec, 1, "all") if setup.ep > 1 else 0) / (setup.tp * setup.pp)
    layers = spec.num_hidden_layers / setup.pp
    parts = _sync(phi - experts, everyone, setup, layers, ddp_after_backward=False)
    if experts:
        replicas = _ring(setup, setup.dp // setup.ep, placement.expert_replica_groups(setup))
        expert_parts = _sync(experts / setup.ep, replicas, setup, layers, ddp_after_backward=True)
        parts = [(b + eb, s + es) for (b, s), (eb, es) in zip(parts, expert_parts, strict=True)]
    (forward, fwd_s), (backward, bwd_s), (after, after_s) = parts
    exposed = max(0.0, fwd_s - forward_share * compute_s)
    exposed += max(0.0, bwd_s - (1 - forward_share) * compute_s) + after_s
    a2a_bytes, a2a_s = _all_to_all(spec, setup)
    return StepComm(
        data_parallel_bytes=forward + backward + after,
        data_parallel_s=fwd_s + bwd_s + after_s,
        all_to_all_bytes=a2a_bytes,
        all_to_all_s=a2a_s,
        exposed_s=exposed + _tensor_parallel_s(spec, setup) + a2a_s,
    )


def _ring(setup: TrainSetup, ranks: int, groups: list[range]) -> _Ring:
    """The rings of `groups`, all syncing at once, at the pace of the slowest: the one whose
    ranks crowd a server past the fast link, or whose servers' NICs carry the most rings."""
    return _Ring(ranks, min(bus_bandwidth(setup.gpu, s.members, s.servers, s.sharing)
                            for s in placement.spans(setup, groups)))  # fmt: skip


def _sync(
    params: float, ring: _Ring, setup: TrainSetup, layers: float, ddp_after_backward: bool
) -> list[tuple[float, float]]:
    """(bytes each GPU moves, seconds) in forward, in backward and after the step to keep
    `params` parameters in sync over `ring` (ZeRO-3 gathering them in each micro-batch)."""
    n, prec = ring.ranks, setup.prec
    share = (n - 1) / n
    grads = share * params * prec.grad_bytes  # one reduce-scatter's volume
    gather = share * params * prec.param_bytes  # one all-gather's volume
    forward = backward = after = 0.0  # bytes each GPU moves in each part of the step
    calls = (0, 0, 0)  # collective calls in each part: n - 1 ring steps each
    if n > 1 and setup.zero == 3:  # gathered again for each micro-batch's pass
        forward, backward = gather * setup.grad_accum, gather * setup.grad_accum + grads
        calls = (layers * setup.grad_accum, layers * (setup.grad_accum + 1), 0)
    elif n > 1 and setup.zero > 0:  # reduce-scatter; the updated shards gathered after
        backward, after, calls = grads, gather, (0, layers, 1)
    elif n > 1 and ddp_after_backward:  # DDP leaves them out; all-reduced after backward
        after, calls = 2 * grads, (0, 0, 1)
    elif n > 1:  # DDP: an all-reduce, as much as a reduce-scatter and an all-gather
        backward, calls = 2 * grads, (0, layers, 0)
    hops = (n - 1) * HOP_LATENCY_S
    return [(b, b / ring.bandwidth + c * hops) for b, c in
            zip((forward, backward, after), calls, strict=True)]  # fmt: skip


def _all_to_all(spec: ModelSpec, setup: TrainSetup) -> tuple[float, float]:
    """Bytes each GPU sends to other ranks, and seconds, of a step's expert all-to-alls.

    Each sends a micro-batch's tokens × top-k hidden states (in the dtype of the residual
    stream: fp32 under autocast) spread evenly over the ep ranks; the 1/ep routed to its own
    experts stays put. An ep group is ep neighbouring data-parallel ranks: inside a server
    it uses the GPU's link; spanning servers, the part bound for other servers shares the
    NICs with every other GPU of the server, all exchanging at once."""
    ep = setup.ep
    if ep == 1:
        return 0.0, 0.0
    e = 4 if setup.autocast else setup.prec.act_bytes
    payload = setup.micro_batch * setup.seq_len * spec.num_experts_per_tok * spec.hidden_size * e
    nic = setup.gpu.node_network_bandwidth / setup.gpus_per_node

    def seconds(local: int) -> float:
        """One all-to-all for a rank whose group has `local` ranks on its server."""
        on_node = (local - 1) / ep * payload / bus_bandwidth(setup.gpu, local, 1)
        return max(on_node, (ep - local) / ep * payload / nic)

    # The ep - 1 sends are posted at once: one hop's latency, not a ring's. The slowest
    # rank sets the pace.
    per_call = max(map(seconds, _group_shares(setup))) + HOP_LATENCY_S
    # dispatch and combine in forward, both again for the gradients in backward, and the
    # forward's again when full recomputation re-runs each layer
    calls_per_layer = 6 if setup.recompute == "full" else 4
    calls = calls_per_layer * spec.num_hidden_layers / setup.pp * setup.grad_accum
    return calls * (ep - 1) / ep * payload, calls * per_call


def _group_shares(setup: TrainSetup) -> set[int]:
    """How many ranks of an ep group (ep neighbouring data-parallel ranks) share a server,
    for every group and server it touches."""
    return {n for g in placement.expert_groups(setup)
            for n in placement.shares_on_servers(setup, g).values()}  # fmt: skip


def _tensor_parallel_s(spec: ModelSpec, setup: TrainSetup) -> float:
    """Megatron's four all-reduces per layer (two forward, two backward) of each
    micro-batch's hidden states, over the intra-node link."""
    if setup.tp == 1:
        return 0.0
    tokens = setup.micro_batch * setup.seq_len
    payload = tokens * spec.hidden_size * setup.prec.act_bytes
    ring = 2 * (setup.tp - 1) / setup.tp * payload / bus_bandwidth(setup.gpu, setup.tp, 1)
    layers = spec.num_hidden_layers / setup.pp
    return 4 * layers * (ring + (setup.tp - 1) * HOP_LATENCY_S) * setup.grad_accum
