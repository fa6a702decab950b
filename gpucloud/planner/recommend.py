"""Which GPUs, how many, and how: every catalog GPU tried against a task, cheapest first.

Training: for each GPU type, GPU counts from 1 up to `max_gpus` and memory strategies from
the fastest to the leanest (DDP, ZeRO-1, -2, -3, ZeRO-3 with full recomputation, then with
the optimizer offloaded to the host, whose RAM must hold it); the cheapest configuration
whose peak fits with the headroom wins (fewer GPUs on a tie). Serving: for each GPU type
and quantization, the smallest tensor-parallel degree whose cache holds the target
concurrency of full-length sequences within (1 - headroom) of GPU memory. Whatever does
not fit says why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from gpucloud.errors import UserError
from gpucloud.hardware import Accelerator, all_accelerators
from gpucloud.models.spec import ModelSpec
from gpucloud.planner.estimate import estimate_inference, estimate_training
from gpucloud.planner.setup import ServeSetup, TrainSetup, check_tp

TASKS = ("train", "serve")
# (zero stage, recompute, offload optimizer), from the fastest to the leanest on memory.
TRAIN_STRATEGIES = [
    (0, "none", False),
    (1, "none", False),
    (2, "none", False),
    (3, "none", False),
    (3, "full", False),
    (3, "full", True),
]
SERVE_QUANTS = ("bf16", "fp8", "int8", "int4")
# Host RAM of a GPU server that offloaded states may fill: 2 TiB, a common 8-GPU build.
HOST_MEMORY_BYTES = 2 * 2**40


@dataclass(frozen=True)
class Option:
    """One configuration: what it is, whether it fits, what it costs, and why."""

    gpu: str
    gpus: int
    strategy: str
    fits: bool
    per_gpu_bytes: float  # peak (training) or required (serving) bytes per GPU
    gpu_memory_bytes: int
    usd_per_hour: float
    tokens_per_s: float
    usd: float | None = None  # training: the whole token budget
    time_s: float | None = None  # training: the whole token budget
    usd_per_million_tokens: float | None = None  # serving: generated tokens
    reason: str = ""
    settings: dict = field(default_factory=dict)  # flags that reproduce it with `plan`


@dataclass(frozen=True)
class Recommendation:
    task: str
    model: str
    headroom: float
    options: list[Option]  # fitting, cheapest first
    rejected: list[Option]  # did not fit anywhere, with the reason

    def to_dict(self) -> dict:
        return {
            "task": self.task,
            "model": self.model,
            "headroom": self.headroom,
            "options": [asdict(o) for o in self.options],
            "rejected": [asdict(o) for o in self.rejected],
        }


def recommend(
    spec: ModelSpec,
    task: str,
    *,
    tokens: float = 1e9,
    seq_len: int = 4096,
    micro_batch: int = 1,
    precision: str = "bf16",
    concurrency: int = 1,
    max_seq_len: int = 4096,
    headroom: float = 0.10,
    max_gpus: int = 512,
    gpus: list[Accelerator] | None = None,
) -> Recommendation:
    """Configurations that run `task` with `headroom` to spare, cheapest first.

    Raises UserError for an unknown task or a headroom outside [0, 1).
    """
    if task not in TASKS:
        raise UserError(f"--task must be one of {', '.join(TASKS)} (got {task!r})")
    if not 0 <= headroom < 1:
        raise UserError(f"--headroom must be in [0, 1) (got {headroom})")
    if max_gpus < 1:
        raise UserError(f"--max-gpus must be a positive integer (got {max_gpus})")
    catalog = gpus or all_accelerators()
    if task == "train":
        results = [_best_training(spec, g, tokens, seq_len, micro_batch, precision, headroom,
                                  max_gpus) for g in catalog]  # fmt: skip
        key = _by_training_cost
    else:
        results = [o for g in catalog
                   for o in _serving(spec, g, concurrency, max_seq_len, headroom)]  # fmt: skip
        key = _by_hourly_cost
    fitting = sorted((o for o in results if o.fits), key=key)
    rejected = [o for o in results if not o.fits]
    return Recommendation(task, spec.name, headroom, fitting, rejected)


def _by_training_cost(o: Option) -> tuple:
    return (o.usd, o.gpus)


def _by_hourly_cost(o: Option) -> tuple:
    return (o.usd_per_hour, -o.tokens_per_s)


def _gpu_counts(gpu: Accelerator, max_gpus: int) -> list[int]:
    counts = [n for n in (1, 2, 4, 8) if n <= min(gpu.gpus_per_node, max_gpus)]
    nodes = 2
    while nodes * gpu.gpus_per_node <= max_gpus:
        counts.append(nodes * gpu.gpus_per_node)
        nodes *= 2
    return counts


def _strategy_name(zero: int, recompute: str, offload: bool) -> str:
    name = "DDP" if zero == 0 else f"ZeRO-{zero}"
    if recompute != "none":
        name += f" + {recompute} recompute"
    return name + (" + optimizer offload" if offload else "")


def _best_training(
    spec: ModelSpec,
    gpu: Accelerator,
    tokens: float,
    seq_len: int,
    micro_batch: int,
    precision: str,
    headroom: float,
    max_gpus: int,
) -> Option:
    best: Option | None = None
    leanest: Option | None = None
    for count in _gpu_counts(gpu, max_gpus):
        per_node = min(count, gpu.gpus_per_node)
        for zero, recompute, offload in TRAIN_STRATEGIES:
            setup = TrainSetup(gpu, gpus_per_node=per_node, nodes=count // per_node, zero=zero,
                               precision=precision, micro_batch=micro_batch, seq_len=seq_len,
                               recompute=recompute, offload_optimizer=offload)  # fmt: skip
            plan = estimate_training(spec, setup, tokens)
            option = Option(
                gpu=gpu.name,
                gpus=count,
                strategy=_strategy_name(zero, recompute, offload),
                fits=plan.memory.fits_with_headroom(headroom)
                and plan.memory.host_offload_bytes_per_node <= HOST_MEMORY_BYTES,
                per_gpu_bytes=plan.memory.total_bytes,
                gpu_memory_bytes=gpu.memory_bytes,
                usd_per_hour=count * gpu.price_per_hour,
                tokens_per_s=plan.speed.tokens_per_s,
                usd=plan.cost.usd,
                time_s=plan.cost.time_s,
                settings={
                    "gpus": per_node,
                    "nodes": count // per_node,
                    "zero": zero,
                    "recompute": recompute,
                    "offload_optimizer": offload,
                },  # fmt: skip
            )
            leanest = option
            if option.fits:
                if best is None or (option.usd, option.gpus) < (best.usd, best.gpus):
                    best = option
                break  # leaner strategies at this count only cost more
    if best is not None:
        return _with_reason(best, headroom, "fits")
    assert leanest is not None
    return _with_reason(leanest, headroom, f"does not fit on up to {max_gpus} GPUs")


def _with_reason(option: Option, headroom: float, verdict: str) -> Option:
    limit = (1 - headroom) * option.gpu_memory_bytes
    reason = (
        f"{verdict}: {option.strategy} on {option.gpus} needs {option.per_gpu_bytes / 2**30:.1f}"
        f" GiB per GPU, limit {limit / 2**30:.1f} GiB ({headroom:.0%} headroom)"
    )
    return Option(**{**asdict(option), "reason": reason})


def _serving(
    spec: ModelSpec, gpu: Accelerator, concurrency: int, max_seq_len: int, headroom: float
) -> list[Option]:
    """One option per quantization: the smallest tensor-parallel degree that fits."""
    options = []
    degrees = [tp for tp in (1, 2, 4, 8) if tp <= gpu.gpus_per_node and _splits(spec, tp)]
    for quant in SERVE_QUANTS:
        if quant == "fp8" and not gpu.has_fp8:
            options.append(_no_fp8(gpu))
            continue
        last = None
        for tp in degrees:
            setup = ServeSetup(gpu, quant=quant, max_seq_len=max_seq_len, tp=tp,
                               memory_fraction=1 - headroom, concurrency=concurrency)  # fmt: skip
            plan = estimate_inference(spec, setup)
            last = Option(
                gpu=gpu.name,
                gpus=tp,
                strategy=quant,
                fits=plan.fits,
                per_gpu_bytes=plan.memory.required_bytes,
                gpu_memory_bytes=gpu.memory_bytes,
                usd_per_hour=plan.cost.usd_per_hour,
                tokens_per_s=plan.speed.decode_tokens_per_s,
                usd_per_million_tokens=plan.cost.usd_per_million_tokens,
                settings={"quant": quant, "tp": tp, "max_seq_len": max_seq_len},
            )
            if plan.fits:
                break
        if last is not None:
            verdict = "fits" if last.fits else f"does not fit at tp up to {last.gpus}"
            reason = _serve_reason(last, verdict, concurrency, max_seq_len, headroom)
            options.append(Option(**{**asdict(last), "reason": reason}))
    return options


def _splits(spec: ModelSpec, tp: int) -> bool:
    try:
        check_tp(spec, tp)
    except UserError:
        return False
    return True


def _serve_reason(
    option: Option, verdict: str, concurrency: int, max_seq_len: int, headroom: float
) -> str:
    limit = (1 - headroom) * option.gpu_memory_bytes
    return (
        f"{verdict}: {concurrency} × {max_seq_len} tokens need "
        f"{option.per_gpu_bytes / 2**30:.1f} GiB per GPU, limit {limit / 2**30:.1f} GiB"
    )


def _no_fp8(gpu: Accelerator) -> Option:
    return Option(
        gpu=gpu.name,
        gpus=0,
        strategy="fp8",
        fits=False,
        per_gpu_bytes=0,
        gpu_memory_bytes=gpu.memory_bytes,
        usd_per_hour=0,
        tokens_per_s=0,
        reason="no fp8 tensor cores",
    )
