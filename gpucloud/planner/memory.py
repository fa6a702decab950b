"""Training memory per GPU: model states by the ZeRO paper, plus what a run really peaks at.

Model states follow Rajbhandari et al. (ZeRO, 2020) exactly: with Φ parameters, K bytes of
optimizer state per parameter (fp32 master + Adam's m, v: K = 12) and data-parallel degree
N, a GPU holds (2 + 2 + K)·Φ under DDP, 2Φ + 2Φ + K·Φ/N under ZeRO-1, 2Φ + (2 + K)·Φ/N
under ZeRO-2 and (2 + 2 + K)·Φ/N under ZeRO-3. Tensor and pipeline parallelism divide Φ
first. The peak of a real step adds transient lines, each stated on its own:

- saved activations (`activations`: component-wise count of our decoder);
- cross-entropy: the fp32 log-softmax it saves and, at the start of backward, the fp32
  gradients of it and of its input (a pipeline schedule also keeps every micro-batch's
  logits, to return them);
- ZeRO-3's gathered layers (current + prefetched, and FSDP2's root group: embeddings and
  LM head) and one layer's unsharded gradients;
  DDP's flat gradient buckets (a second copy of the gradients, kept between steps);
- the optimizer step's temporaries (foreach AdamW: one state-sized buffer);
- a fixed runtime overhead (CUDA context, cuBLAS/NCCL workspaces) and allocator
  fragmentation, outside the tensors.

The peak is the largest of three moments: the start of backward (activations and
cross-entropy at their largest, gradients not yet allocated because `zero_grad` set them to
None), the optimizer step (all gradients, temporaries), and — under full recomputation —
the backward of the first layer (nearly all gradients, one recomputed layer).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from gpucloud.models.spec import ModelSpec
from gpucloud.planner import activations as act
from gpucloud.planner.setup import TrainSetup, optimizer_state_bytes

GiB = 2**30
RUNTIME_OVERHEAD = 1 * GiB  # CUDA context + cuBLAS and NCCL workspaces, outside torch's allocator
FRAGMENTATION = 0.05  # caching-allocator blocks reserved but not allocated, share of the peak


@dataclass(frozen=True)
class StageMemory:
    """Per-GPU bytes on one pipeline stage (the first and the last differ)."""

    stage: str  # "all" without pipelining, else "first" or "last"
    params_bytes: float
    grads_bytes: float
    master_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    logits_bytes: float  # cross-entropy's share of the peak at the start of backward
    gathered_bytes: float  # ZeRO-3 gathered layers + one layer's unsharded gradients
    comm_buffers_bytes: float
    optimizer_temp_bytes: float
    phases: dict[str, float]  # allocated bytes at each candidate peak moment

    @property
    def model_states_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.master_bytes + self.optimizer_bytes

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__)

    @property
    def peak_bytes(self) -> float:
        return self.phases[self.peak_phase]


@dataclass(frozen=True)
class TrainingMemory:
    """The worst pipeline stage's memory, the overheads, and the textbook conventions."""

    stage: StageMemory
    runtime_overhead_bytes: float
    fragmentation_bytes: float
    gpu_memory_bytes: int
    host_offload_bytes_per_node: float
    zero_paper_bytes: float  # ZeRO-paper model states per GPU, offload ignored
    zero_paper_formula: str
    deepspeed_estimator_bytes: float | None  # DeepSpeed's own estimator, ZeRO-2/3 only
    korthikanti_activations_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.stage.peak_bytes + self.runtime_overhead_bytes + self.fragmentation_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.gpu_memory_bytes

    @property
    def shortfall_bytes(self) -> float:
        return max(0.0, self.total_bytes - self.gpu_memory_bytes)

    def fits_with_headroom(self, headroom: float) -> bool:
        return self.total_bytes <= (1 - headroom) * self.gpu_memory_bytes

    def per_gpu(self) -> dict:
        d = {k: round(v) if isinstance(v, float) else v for k, v in asdict(self.stage).items()}
        d["phases"] = {k: round(v) for k, v in self.stage.phases.items()}
        d.update(
            model_states_bytes=round(self.stage.model_states_bytes),
            peak_phase=self.stage.peak_phase,
            peak_allocated_bytes=round(self.stage.peak_bytes),
            runtime_overhead_bytes=round(self.runtime_overhead_bytes),
            fragmentation_bytes=round(self.fragmentation_bytes),
            total_bytes=round(self.total_bytes),
            gpu_memory_bytes=self.gpu_memory_bytes,
        )
        return d


def stage_params(spec: ModelSpec, pp: int, stage: str) -> int:
    """Parameters held by one pipeline stage: its layers, plus embeddings on the first and the
    final norm and LM head on the last (a tied LM head is a second copy once split)."""
    layers = act.stage_layers(spec, pp) * spec.params_per_layer
    if stage == "all":
        return spec.num_params
    if stage == "first":
        return layers + spec.embedding_params
    head = spec.vocab_size * spec.hidden_size
    return layers + spec.hidden_size + head


def estimate_training_memory(spec: ModelSpec, setup: TrainSetup) -> TrainingMemory:
    """Per-GPU training memory for `spec` under `setup` (assumed checked)."""
    stages = ["all"] if setup.pp == 1 else ["first", "last"]
    worst = max((_stage(spec, setup, s) for s in stages), key=lambda m: m.peak_bytes)
    prec, n = setup.prec, setup.dp
    k = prec.master_bytes + optimizer_state_bytes(setup.optimizer, prec)
    phi = spec.num_params / (setup.tp * setup.pp)
    return TrainingMemory(
        stage=worst,
        runtime_overhead_bytes=RUNTIME_OVERHEAD,
        fragmentation_bytes=FRAGMENTATION * worst.peak_bytes,
        gpu_memory_bytes=setup.gpu.memory_bytes,
        host_offload_bytes_per_node=_offload_bytes(spec, setup) * setup.gpus_per_node,
        zero_paper_bytes=_zero_paper(phi, prec.param_bytes, prec.grad_bytes, k, setup.zero, n),
        zero_paper_formula=_zero_formula(prec.param_bytes, prec.grad_bytes, k, setup.zero),
        deepspeed_estimator_bytes=deepspeed_estimate(
            spec.num_params,
            deepspeed_largest_layer(spec),
            setup.zero,
            setup.world,
            setup.offload_optimizer,
        ),
        korthikanti_activations_bytes=_korthikanti(spec, setup, worst.stage),
    )


def _shard(zero: int, from_stage: int, dp: int) -> int:
    """ZeRO stage `from_stage` and above shard this state over the data-parallel ranks."""
    return dp if zero >= from_stage else 1


def _stage(spec: ModelSpec, setup: TrainSetup, stage: str) -> StageMemory:
    prec, dp, zero = setup.prec, setup.dp, setup.zero
    phi = stage_params(spec, setup.pp, stage) / setup.tp
    offload = setup.offload_optimizer
    # FSDP2's CPUOffloadPolicy (ZeRO-3) keeps the parameter and gradient shards on the host.
    on_gpu = 0 if offload and zero == 3 else 1
    params = on_gpu * phi * prec.param_bytes / _shard(zero, 3, dp)
    grads = on_gpu * phi * prec.grad_bytes / _shard(zero, 2, dp)
    master = 0 if offload else phi * prec.master_bytes / _shard(zero, 1, dp)
    opt_state = optimizer_state_bytes(setup.optimizer, prec)
    optimizer = 0 if offload else phi * opt_state / _shard(zero, 1, dp)
    temp = 0 if offload or setup.optimizer != "adamw" else optimizer / 2

    tokens = setup.micro_batch * setup.seq_len
    e, tp, sp, autocast = prec.act_bytes, setup.tp, setup.sequence_parallel, setup.autocast
    in_flight = _in_flight(setup, stage)
    layers = act.stage_layers(spec, setup.pp)
    has_head = stage in ("all", "last")
    if setup.recompute == "full":
        per_layer = act.checkpoint_layer_bytes(spec, 4 if autocast else e, tp, sp)
        shared = act.checkpoint_shared_bytes(spec)
    else:
        per_layer = act.decoder_layer_bytes(spec, e, tp, sp, autocast)
        shared = act.decoder_shared_bytes(spec, e)
    final = act.final_norm_bytes(spec, e, tp, sp, autocast) if has_head else 0
    activations = tokens * (in_flight * (layers * per_layer + shared) + final)
    # The loss of each micro-batch in flight keeps its log-softmax (GPipe's last stage: all
    # of them); a pipeline schedule also keeps every micro-batch's logits, its output.
    held = in_flight * tokens * act.cross_entropy_held_bytes(spec, tp) if has_head else 0
    ce_grads = tokens * act.cross_entropy_backward_bytes(spec, tp) if has_head else 0
    outputs = tokens * act.logits_bytes(spec, e, tp) if has_head and setup.pp > 1 else 0
    held += setup.grad_accum * outputs

    largest = spec.params_per_layer / tp
    gathered = 0.0
    comm = 0.0
    if dp > 1 and zero <= 1:
        # DDP's flat buckets: a second copy of the gradients, allocated once and kept all
        # run (param.grad itself is freed by zero_grad). fp32 under autocast.
        comm = phi * (4 if autocast else prec.grad_bytes)
    elif dp > 1:
        comm = largest * prec.grad_bytes  # one layer's unsharded grads before reduce-scatter
        if zero == 3:
            gathered = 2 * largest * prec.param_bytes  # current + prefetched layer
            # FSDP2's root group (embeddings, final norm, LM head) is gathered from the
            # first forward to the end of backward: the root does not reshard after forward.
            layers = act.stage_layers(spec, setup.pp) * spec.params_per_layer
            gathered += (stage_params(spec, setup.pp, stage) - layers) / tp * prec.param_bytes

    # Under DDP + torch.autocast the model's fp32 weights are the master copy and the 16-bit
    # "parameters" are autocast's cached casts, alive from forward to the end of backward:
    # the same bytes at each phase as the ZeRO paper's split, so one accounting serves both.
    states = params + master + optimizer + comm + gathered
    if autocast:  # except for the weights no matmul reads: they are never cast
        states -= prec.param_bytes * uncast_params(spec, setup.pp, stage) / tp
    phases = {
        "backward start": states + activations + held + ce_grads + _accumulated_grads(setup, phi),
        "optimizer step": params + master + optimizer + comm + grads + temp,
    }
    if setup.recompute == "full":
        phases["recomputed layer"] = (
            states
            + setup.grad_accum * outputs
            + _first_layer_backward(spec, setup, stage, grads, tokens * per_layer)
        )
    return StageMemory(
        stage=stage,
        params_bytes=params,
        grads_bytes=grads,
        master_bytes=master,
        optimizer_bytes=optimizer,
        activations_bytes=activations,
        logits_bytes=held + ce_grads,
        gathered_bytes=gathered,
        comm_buffers_bytes=comm,
        optimizer_temp_bytes=temp,
        phases=phases,
    )


def _in_flight(setup: TrainSetup, stage: str) -> int:
    """Micro-batches whose activations a pipeline stage holds at once: GPipe runs every
    forward before any backward; 1F1B's first stage holds pp of them, its last one."""
    if setup.pp == 1:
        return 1
    if setup.pipeline_schedule == "gpipe":
        return setup.grad_accum
    return min(setup.pp, setup.grad_accum) if stage == "first" else 1


def _accumulated_grads(setup: TrainSetup, phi: float) -> float:
    """Gradients already summed when a later micro-batch's backward starts: each rank's
    whole gradient, unsharded under FSDP2 too (it skips the reduce-scatter until the last
    micro-batch), fp32 under autocast (the weights are)."""
    if setup.grad_accum == 1:
        return 0.0
    return phi * (4 if setup.autocast else setup.prec.grad_bytes)


def uncast_params(spec: ModelSpec, pp: int, stage: str) -> int:
    """Parameters torch.autocast never casts, as no matmul reads them: the norms, and the
    embeddings unless the LM head shares them on the same stage."""
    norms = spec.hidden_size * (2 * act.stage_layers(spec, pp) + (stage != "first"))
    tied_here = spec.tie_word_embeddings and stage == "all"
    embedding = spec.embedding_params if stage in ("all", "first") and not tied_here else 0
    return embedding + norms


def _first_layer_backward(
    spec: ModelSpec, setup: TrainSetup, stage: str, grads: float, checkpoint: float
) -> float:
    """Under full recomputation, the MLP backward of the first decoder layer: the gradients
    computed so far (all but the embeddings', unless tied to the LM head, and all of this
    layer's but down_proj's), the layer's checkpoint and recomputed activations, the
    gradient flowing in from the layer above, and the MLP-width gradients of silu(gate) and
    up that replace the freed product. Measured on CPU this is within 1% in fp32 and up to
    4% low in bf16, where the recomputed forward leaves a few hidden-size tensors alive."""
    e, tp, sp = setup.prec.act_bytes, setup.tp, setup.sequence_parallel
    tokens = setup.micro_batch * setup.seq_len
    total = stage_params(spec, setup.pp, stage)
    pending = spec.params_per_layer - spec.hidden_size * spec.intermediate_size
    if stage in ("all", "first") and not (spec.tie_word_embeddings and stage == "all"):
        pending += spec.embedding_params
    incoming = e * spec.hidden_size / (tp if sp else 1)
    mlp_grads = 2 * e * spec.intermediate_size / tp
    layer = act.decoder_layer_bytes(spec, e, tp, sp, setup.autocast) + incoming + mlp_grads
    if setup.autocast:  # the fp32 weights get fp32 gradients
        grads *= 4 / setup.prec.grad_bytes
    return grads * (1 - pending / total) + checkpoint + tokens * layer


def _offload_bytes(spec: ModelSpec, setup: TrainSetup) -> float:
    """Host bytes per GPU for offloaded fp32 master and optimizer states (ZeRO-Offload), and
    at ZeRO-3 the parameter and gradient shards (FSDP2's CPUOffloadPolicy: under mixed
    precision its fp32 parameter shard is the master and its gradients are fp32, the same
    bytes in total)."""
    if not setup.offload_optimizer:
        return 0.0
    prec = setup.prec
    k = prec.master_bytes + optimizer_state_bytes(setup.optimizer, prec)
    if setup.zero == 3:
        k += prec.param_bytes + prec.grad_bytes
    return spec.num_params / (setup.tp * setup.pp) * k / setup.dp


def _zero_paper(phi: float, p: int, g: int, k: float, zero: int, n: int) -> float:
    return phi * (p / _shard(zero, 3, n) + g / _shard(zero, 2, n) + k / _shard(zero, 1, n))


def _zero_formula(p: int, g: int, k: float, zero: int) -> str:
    """The ZeRO paper's per-GPU model-state formula for this precision, e.g. '2Φ + 14Φ/N'."""
    parts = [p, g, k]
    whole = sum(parts[: 3 - zero]) if zero < 3 else 0
    split = sum(parts[3 - zero :]) if zero else 0
    terms = [f"{whole:g}Φ"] if whole else []
    terms += [f"{split:g}Φ/N"] if split else []
    return " + ".join(terms)


def deepspeed_largest_layer(spec: ModelSpec) -> int:
    """DeepSpeed's "largest layer": the largest single module's own parameters."""
    h = spec.hidden_size
    return max(spec.vocab_size * h, h * spec.intermediate_size, h * spec.q_size)


def deepspeed_estimate(
    params: int, largest_layer: int, zero: int, world: int, offload: bool
) -> float | None:
    """Model-state bytes per GPU by DeepSpeed's estimators (`estimate_zero2_model_states_
    mem_needs` for stages 1-2, `estimate_zero3_...` for stage 3: 18 B/param + 4× the largest
    layer). None for ZeRO-0, which DeepSpeed does not estimate."""
    if zero == 0:
        return None
    if zero in (1, 2):
        return 2 * params if offload else 4 * params + int(16 * params / world)
    largest = 4 * largest_layer
    return largest + int((2 if offload else 18) * params / world)


def _korthikanti(spec: ModelSpec, setup: TrainSetup, stage: str) -> float:
    tokens = setup.micro_batch * setup.seq_len
    in_flight = _in_flight(setup, stage)
    per_layer = act.korthikanti_layer_bytes(
        spec, setup.seq_len, setup.prec.act_bytes, setup.recompute, setup.tp,
        setup.sequence_parallel,
    )  # fmt: skip
    return tokens * in_flight * act.stage_layers(spec, setup.pp) * per_layer
