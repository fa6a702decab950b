"""What a plan is asked about: a training or a serving setup, checked once at construction.

Each check raises a UserError naming the bad value and what is allowed, so the CLI turns it
into one line and exit code 2. Checks that need the model (heads vs tensor parallelism) take
the `ModelSpec` in `check(spec)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpucloud.errors import UserError
from gpucloud.hardware import Accelerator
from gpucloud.models.spec import ModelSpec


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state, and of the activations the decoder saves."""

    name: str
    param_bytes: int  # the weights the forward pass reads
    grad_bytes: int
    master_bytes: int  # fp32 copy the optimizer updates (mixed precision only)
    state_bytes: int  # one optimizer state element (Adam's m or v, SGD's momentum)
    act_bytes: int  # compute dtype of activations
    about: str


PRECISIONS = {
    p.name: p
    for p in [
        Precision("fp32", 4, 4, 0, 4, 4, "fp32 weights, grads, optimizer states, activations"),
        Precision("bf16", 2, 2, 4, 4, 2, "bf16 weights/grads/activations, fp32 master + states"),
        Precision("fp16", 2, 2, 4, 4, 2, "fp16 weights/grads/activations, fp32 master + states"),
        Precision("pure-bf16", 2, 2, 0, 2, 2, "bf16 everything, no fp32 master"),
    ]
}

# States per parameter: AdamW keeps m and v; SGD keeps momentum; 8-bit Adam (bitsandbytes,
# block-wise) keeps m and v in one byte each plus an fp32 absmax per 256-value block.
OPTIMIZERS = ("adamw", "sgd", "adam8bit")
SCHEDULES = {
    "1f1b": "one forward, one backward: stage s holds pp - s micro-batches in flight",
    "gpipe": "all forwards, then all backwards: every stage holds every micro-batch",
}
RECOMPUTE = {
    "none": "every activation the decoder saves is kept for backward",
    "selective": "attention scores recomputed (flash attention never stores them: "
    "for our decoder the same as none)",
    "full": "each decoder layer re-runs in backward; only its input is kept",
}


def optimizer_state_bytes(optimizer: str, precision: Precision) -> float:
    """Optimizer-state bytes per parameter, master weights excluded."""
    if optimizer == "adamw":
        return 2 * precision.state_bytes
    if optimizer == "sgd":
        return precision.state_bytes
    return 2 * (1 + 4 / 256)


def _choice(flag: str, value: str, allowed) -> None:
    if value not in allowed:
        raise UserError(f"{flag} must be one of {', '.join(allowed)} (got {value!r})")


@dataclass(frozen=True)
class TrainSetup:
    """A training run: hardware, parallelism, precision and the micro-batch shape."""

    gpu: Accelerator
    gpus_per_node: int = 1
    nodes: int = 1
    zero: int = 0
    precision: str = "bf16"
    optimizer: str = "adamw"
    micro_batch: int = 1
    seq_len: int = 2048
    recompute: str = "none"
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    offload_optimizer: bool = False
    """Optimizer states (and the fp32 master) in host memory, the step run on the host. At
    ZeRO-3 as FSDP2's CPUOffloadPolicy does it: the parameter and gradient shards live there
    too, and the GPU holds only the layers being gathered."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank: gradient accumulation, or the
    pipeline's micro-batches (the bubble shrinks as they grow)."""
    pipeline_schedule: str = "1f1b"
    mfu: float = 0.4  # fraction of the dense bf16 peak the kernels reach (hardware FLOPs)

    def __post_init__(self) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise UserError(f"--zero must be 0, 1, 2 or 3 (got {self.zero})")
        _choice("--precision", self.precision, PRECISIONS)
        _choice("--optimizer", self.optimizer, OPTIMIZERS)
        _choice("--recompute", self.recompute, RECOMPUTE)
        _choice("--pipeline-schedule", self.pipeline_schedule, SCHEDULES)
        for flag, value in (("--gpus", self.gpus_per_node), ("--nodes", self.nodes),
                            ("--micro-batch", self.micro_batch), ("--seq-len", self.seq_len),
                            ("--tp", self.tp), ("--pp", self.pp),
                            ("--grad-accum", self.grad_accum)):  # fmt: skip
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{flag} must be a positive integer (got {value})")
        if not 0 < self.mfu <= 1:
            raise UserError(f"--mfu must be in (0, 1] (got {self.mfu})")
        if self.gpus_per_node % self.tp:
            raise UserError(
                f"--tp {self.tp} must divide --gpus {self.gpus_per_node}: tensor parallelism "
                "stays inside a node"
            )
        if self.world % (self.tp * self.pp):
            raise UserError(
                f"--tp × --pp ({self.tp} × {self.pp}) must divide the {self.world} GPUs "
                "(--gpus × --nodes)"
            )
        if self.sequence_parallel and self.tp == 1:
            raise UserError("--sequence-parallel needs --tp 2 or more")
        if self.offload_optimizer and self.zero == 0:
            raise UserError("--offload-optimizer needs --zero 1, 2 or 3 (ZeRO-Offload)")

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def dp(self) -> int:
        """Data-parallel degree: the GPUs ZeRO shards model states over."""
        return self.world // (self.tp * self.pp)

    @property
    def prec(self) -> Precision:
        return PRECISIONS[self.precision]

    @property
    def autocast(self) -> bool:
        """Mixed precision as the training runtime runs it: DDP (ZeRO-0/1) under
        torch.autocast with fp32 weights; FSDP (ZeRO-2/3) casts the weights themselves."""
        return self.prec.master_bytes > 0 and self.zero <= 1

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_len * self.grad_accum * self.dp

    @property
    def bubble(self) -> float:
        """Share of a pipelined step a stage idles, (pp-1)/(m+pp-1) for GPipe and 1F1B."""
        return (self.pp - 1) / (self.grad_accum + self.pp - 1)

    def check(self, spec: ModelSpec) -> None:
        """Raise UserError when the model cannot be split the way this setup asks."""
        check_tp(spec, self.tp)
        if self.pp > spec.num_hidden_layers:
            raise UserError(
                f"--pp {self.pp} exceeds the {spec.num_hidden_layers} layers of {spec.name}"
            )


def check_tp(spec: ModelSpec, tp: int) -> None:
    """Tensor parallelism splits attention heads; KV heads split or replicate evenly."""
    heads, kv = spec.num_attention_heads, spec.num_key_value_heads
    if heads % tp:
        raise UserError(f"--tp {tp} must divide the {heads} attention heads of {spec.name}")
    if kv % tp and tp % kv:
        raise UserError(
            f"--tp {tp} must divide, or be a multiple of, the {kv} KV heads of {spec.name}"
        )


QUANTS = {
    # bytes per weight of the quantized linear layers. int4 is group-wise (group 128) with a
    # 16-bit scale and a 4-bit zero point per group, as GPTQ/AWQ store it; int8 has one scale
    # per output channel (inference.weights_bytes counts int8 and int4 exactly, layer by
    # layer); fp8 one fp32 scale per output channel (negligible).
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5 + (2 + 0.5) / 128,
}
KV_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclass(frozen=True)
class ServeSetup:
    """A model served on `tp` GPUs with a paged KV cache in a fraction of GPU memory."""

    gpu: Accelerator
    quant: str = "bf16"
    kv_dtype: str = "auto"  # auto: the compute dtype (fp32 for fp32 weights, else bf16)
    max_seq_len: int = 4096
    tp: int = 1
    memory_fraction: float = 0.9
    concurrency: int | None = None  # sequences of max_seq_len that must fit at once
    block_size: int = 16  # tokens per KV block: the cache holds whole blocks
    prefill_chunk: int = 8192  # tokens per forward pass: sizes the activation workspace
    mfu: float = 0.4

    def __post_init__(self) -> None:
        _choice("--quant", self.quant, QUANTS)
        _choice("--kv-dtype", self.kv_dtype, ["auto", *KV_DTYPES])
        ints = [
            ("--max-seq-len", self.max_seq_len),
            ("--tp", self.tp),
            ("--block-size", self.block_size),
            ("--prefill-chunk", self.prefill_chunk),
        ]
        if self.concurrency is not None:
            ints.append(("--concurrency", self.concurrency))
        for flag, value in ints:  # fmt: skip
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{flag} must be a positive integer (got {value})")
        if not 0 < self.memory_fraction <= 1:
            raise UserError(f"--memory-fraction must be in (0, 1] (got {self.memory_fraction})")
        if not 0 < self.mfu <= 1:
            raise UserError(f"--mfu must be in (0, 1] (got {self.mfu})")
        if self.quant == "fp8" and not self.gpu.has_fp8:
            raise UserError(f"{self.gpu.name} has no fp8 support: use --quant int8 or int4")

    @property
    def kv_bytes(self) -> int:
        if self.kv_dtype != "auto":
            return KV_DTYPES[self.kv_dtype]
        return 4 if self.quant == "fp32" else 2

    @property
    def required_seqs(self) -> int:
        return self.concurrency or 1

    def check(self, spec: ModelSpec) -> None:
        check_tp(spec, self.tp)
