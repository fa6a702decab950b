"""Seconds of the collectives a training step adds, over the catalog's links.

Ring collectives as nccl-tests measures them: an all-reduce of B bytes over n ranks moves
2(n-1)/n·B through each rank, a reduce-scatter or an all-gather (n-1)/n·B, at the ring's
bus bandwidth, plus a hop's latency for each of the ring's n-1 steps. Inside one server
the bus bandwidth is the GPU's link one way (half the bidirectional figure vendors quote;
PCIe when the group spans more GPUs than share the fast link). Across servers each ring
crosses every server boundary once, so the NICs of a server together bound it
(`node_network_bandwidth`): 400 GB/s on an HGX H100 node, 6.25 GB/s on a server of
GeForce cards with two 25 GbE ports.

Data parallelism syncs the gradients once per optimizer step: DDP all-reduces them during
backward; ZeRO-1/2 reduce-scatter them during backward and all-gather the updated shards
after the step; ZeRO-3 (FSDP) also gathers each layer's parameters in every micro-batch's
forward and again in its backward. Buckets and prefetching overlap these with compute: the
backward's collectives with backward, ZeRO-3's forward gathers with forward, so only what
exceeds that compute is exposed. ZeRO-1/2's gather after the step and tensor
parallelism's all-reduces (between matmuls) are never hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpucloud.hardware import Accelerator
from gpucloud.models.spec import ModelSpec
from gpucloud.planner.setup import TrainSetup

PCIE_GEN4 = 64e9  # bytes/s bidirectional, x16: where a group leaves the fast-link domain
HOP_LATENCY_S = 10e-6  # one step of a ring: a hop's latency plus the library's overhead


@dataclass(frozen=True)
class StepComm:
    """Seconds per optimizer step, and the bytes each GPU sends for data parallelism."""

    data_parallel_bytes: float  # what each GPU moves for the gradient sync (and ZeRO-3's gathers)
    data_parallel_s: float  # those collectives at the ring's bus bandwidth, hidden or not
    exposed_s: float  # the part compute does not hide, plus tensor parallelism's
    bus_bandwidth: float  # bytes/s of the data-parallel ring


def bus_bandwidth(gpu: Accelerator, per_node: int, nodes: int) -> float:
    """Bytes/s a ring of `per_node` GPUs on each of `nodes` servers sustains per rank."""
    link = gpu.link_bandwidth if per_node <= gpu.link_domain else min(gpu.link_bandwidth,
                                                                       PCIE_GEN4)  # fmt: skip
    intra = link / 2
    return intra if nodes == 1 else min(intra, gpu.node_network_bandwidth)


def step_comm(
    spec: ModelSpec, setup: TrainSetup, compute_s: float, forward_share: float
) -> StepComm:
    """The collectives of one optimizer step taking `compute_s` seconds of compute, of which
    `forward_share` is forward passes (the rest, backward and recomputation, can hide the
    gradients' reduction)."""
    dp, prec = setup.dp, setup.prec
    # The data-parallel group: one rank per (tp, pp) slot, spread over the nodes.
    per_node = max(1, setup.gpus_per_node // (setup.tp * setup.pp))
    bw = bus_bandwidth(setup.gpu, min(per_node, dp), setup.nodes if dp > per_node else 1)
    phi = spec.num_params / (setup.tp * setup.pp)
    share = (dp - 1) / dp
    grads = share * phi * prec.grad_bytes  # one reduce-scatter's volume
    gather = share * phi * prec.param_bytes  # one all-gather's volume
    forward = backward = after = 0.0  # bytes each GPU moves in each part of the step
    calls = (0, 0, 0)  # collective calls in each part: dp - 1 ring steps each
    layers = spec.num_hidden_layers / setup.pp
    if dp > 1 and setup.zero == 3:  # gathered again for each micro-batch's pass
        forward, backward = gather * setup.grad_accum, gather * setup.grad_accum + grads
        calls = (layers * setup.grad_accum, layers * (setup.grad_accum + 1), 0)
    elif dp > 1 and setup.zero > 0:  # reduce-scatter; the updated shards gathered after
        backward, after, calls = grads, gather, (0, layers, 1)
    elif dp > 1:  # DDP: an all-reduce, as much as a reduce-scatter and an all-gather
        backward, calls = 2 * grads, (0, layers, 0)
    hops = (dp - 1) * HOP_LATENCY_S
    fwd_s, bwd_s, after_s = (b / bw + n * hops for b, n in
                             zip((forward, backward, after), calls, strict=True))  # fmt: skip
    exposed = max(0.0, fwd_s - forward_share * compute_s)
    exposed += max(0.0, bwd_s - (1 - forward_share) * compute_s) + after_s
    volume = forward + backward + after
    return StepComm(volume, fwd_s + bwd_s + after_s, exposed + _tensor_parallel_s(spec, setup), bw)


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
