"""Speed from FLOPs and bytes: training step time at a stated utilization, prefill time, and
decode tokens/s bounded by memory bandwidth (small batches) or by FLOPs (large batches).

Training FLOPs per token are 6·N_active plus causal attention (`ModelSpec.flops_per_token`):
model FLOPs, as MFU counts them. Full recomputation runs each forward twice, so the hardware
does 8/6 of that work; `mfu` is the share of the peak the kernels reach on hardware FLOPs.
fp32 math runs on TF32 tensor cores at half the bf16 rate. A pipeline idles each stage for
the bubble, (pp-1)/(m+pp-1) of the step with m micro-batches (GPipe and 1F1B alike); the
collectives the compute does not hide (`comm`: expert parallelism's all-to-alls among them)
and a host optimizer's time add to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpucloud.hardware import Accelerator
from gpucloud.models.spec import ModelSpec
from gpucloud.planner import comm
from gpucloud.planner.setup import ServeSetup, TrainSetup

RECOMPUTE_FACTOR = {"none": 1.0, "selective": 1.0, "full": 4 / 3}


def train_peak_flops(gpu: Accelerator, precision: str) -> float:
    return gpu.bf16_flops / 2 if precision == "fp32" else gpu.bf16_flops


def serve_peak_flops(gpu: Accelerator, quant: str) -> float:
    """Dense peak for the matmuls: fp8/int8 weights with activations in the same type run at
    the 8-bit rate; int4 weights are dequantized to 16-bit (weight-only)."""
    if quant == "fp8":
        return gpu.fp8_flops
    if quant == "int8":
        return gpu.int8_ops
    return gpu.bf16_flops / 2 if quant == "fp32" else gpu.bf16_flops


# ZeRO-Offload runs Adam on the host: order of DeepSpeed's CPU-Adam per node, and the
# gradients down / updated weights up over a PCIe x16 link, one direction achieved.
HOST_ADAM_PARAMS_PER_S = 1e9
HOST_LINK_BYTES_PER_S = 25e9


def offload_step_s(spec: ModelSpec, setup: TrainSetup) -> float:
    """Seconds the host-side optimizer adds to a step (not overlapped with compute)."""
    if not setup.offload_optimizer:
        return 0.0
    shard = spec.num_params / setup.world  # parameters whose states this GPU offloads
    prec = setup.prec
    transfer = shard * (prec.grad_bytes + prec.param_bytes) / HOST_LINK_BYTES_PER_S
    return transfer + shard * setup.gpus_per_node / HOST_ADAM_PARAMS_PER_S


@dataclass(frozen=True)
class TrainSpeed:
    flops_per_token: float  # model FLOPs (6·N + attention)
    hardware_flops_per_token: float  # with recomputation
    compute_s: float  # the step's FLOPs at `mfu` on every GPU, pipeline bubble included
    bubble_fraction: float  # share of compute_s a pipeline stage idles
    comm_s: float  # data-parallel collectives at the ring's bus bandwidth, hidden or not
    exposed_comm_s: float  # what compute does not hide, tensor parallelism's included
    comm_bytes_per_gpu: float  # what each GPU moves for data parallelism per step
    all_to_all_s: float  # expert parallelism's token exchanges (exposed), 0 without it
    all_to_all_bytes_per_gpu: float  # what each GPU sends other ranks in them per step
    step_time_s: float  # compute + exposed communication + the host optimizer
    tokens_per_step: int
    tokens_per_s: float
    mfu: float  # model FLOPs utilization, after bubble, communication and host optimizer


def train_speed(spec: ModelSpec, setup: TrainSetup) -> TrainSpeed:
    model = spec.flops_per_token(setup.seq_len, training=True)
    hardware = model * RECOMPUTE_FACTOR[setup.recompute]
    tokens = setup.tokens_per_step
    rate = setup.world * train_peak_flops(setup.gpu, setup.precision) * setup.mfu
    compute = tokens * hardware / rate / (1 - setup.bubble)
    # Forward is 2 of the 6·N FLOPs per token; recomputation adds a forward to backward.
    sync = comm.step_comm(spec, setup, compute, 1 / (3 * RECOMPUTE_FACTOR[setup.recompute]))
    step = compute + sync.exposed_s + offload_step_s(spec, setup)
    return TrainSpeed(
        flops_per_token=model,
        hardware_flops_per_token=hardware,
        compute_s=compute,
        bubble_fraction=setup.bubble,
        comm_s=sync.data_parallel_s,
        exposed_comm_s=sync.exposed_s,
        comm_bytes_per_gpu=sync.data_parallel_bytes,
        all_to_all_s=sync.all_to_all_s,
        all_to_all_bytes_per_gpu=sync.all_to_all_bytes,
        step_time_s=step,
        tokens_per_step=tokens,
        tokens_per_s=tokens / step,
        mfu=tokens * model / (step * setup.world * train_peak_flops(setup.gpu, setup.precision)),
    )


ALLREDUCE_LATENCY_S = 10e-6  # one small all-reduce inside a node, NCCL-class libraries


def tp_allreduce_s(spec: ModelSpec, gpu: Accelerator, tp: int, tokens: int) -> float:
    """Time of the two all-reduces per layer (after attention and after the MLP) that tensor
    parallelism adds to a forward pass over `tokens` tokens: a ring moves 2(tp-1)/tp of the
    16-bit hidden states each way at half the quoted bidirectional link bandwidth."""
    if tp == 1:
        return 0.0
    payload = tokens * spec.hidden_size * 2
    ring = 2 * (tp - 1) / tp * payload / (gpu.link_bandwidth / 2)
    return 2 * spec.num_hidden_layers * (ring + ALLREDUCE_LATENCY_S)


@dataclass(frozen=True)
class ServeSpeed:
    prefill_time_s: float  # one prompt of max_seq_len tokens
    decode_tokens_per_s_batch1: float  # bandwidth bound: all weights + one sequence's KV
    decode_tokens_per_s_flops_bound: float  # compute bound: any batch size
    decode_tokens_per_s: float  # at `batch` sequences: the smaller of the two bounds
    batch: int


def serve_speed(
    spec: ModelSpec, setup: ServeSetup, weights: float, kv_per_token: float, batch: int
) -> ServeSpeed:
    """Speed of `batch` sequences decoding at half of max_seq_len context on average.

    `weights` and `kv_per_token` are whole-model bytes; the tp GPUs read their shares in
    parallel, then all-reduce (`tp_allreduce_s`). Batch 1 of an MoE reads only the active
    experts.
    """
    tp, gpu = setup.tp, setup.gpu
    flops_rate = tp * serve_peak_flops(gpu, setup.quant) * setup.mfu
    bandwidth = tp * gpu.memory_bandwidth
    context = setup.max_seq_len / 2
    prefill = setup.max_seq_len * spec.flops_per_token(setup.max_seq_len, training=False)
    per_token = spec.flops_per_token(int(context), training=False)
    active = weights * spec.num_active_params / spec.num_params
    batch1 = 1 / ((active + kv_per_token * context) / bandwidth + tp_allreduce_s(spec, gpu, tp, 1))
    flops_bound = flops_rate / per_token
    step_bytes = weights + batch * kv_per_token * context
    step = max(step_bytes / bandwidth, batch / flops_bound) + tp_allreduce_s(spec, gpu, tp, batch)
    at_batch = batch / step
    return ServeSpeed(
        prefill_time_s=prefill / flops_rate,
        decode_tokens_per_s_batch1=batch1,
        decode_tokens_per_s_flops_bound=flops_bound,
        decode_tokens_per_s=at_batch,
        batch=batch,
    )
