"""Planned vs measured peak memory per rank, for layouts the training runtime runs.

Each layout is trained for a few steps by the runtime's own `Trainer` on 2 CPU ranks (gloo)
of this machine (`gpucloud.train.rank_memory`); each rank's peak of live tensor bytes is
read from the allocator's events and printed next to `gpucloud plan train`'s peak allocated
bytes for the same model, strategy, micro-batch, sequence length, precision and recompute
(the GPU-only lines, runtime overhead and fragmentation, left out). The ratio is planned /
measured on the rank that peaks highest (a pipeline's stages differ).

Run: .venv/bin/python benchmarks/planner_vs_runtime.py [--quick]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from gpucloud.models.presets import PRESETS
from gpucloud.planner.memory import estimate_training_memory
from gpucloud.train import config
from gpucloud.train.rank_memory import measure_rank_peaks, planner_setup, write_random_dataset

WORLD = 2
LAYOUTS = {
    # name: overrides of the base run (global batch = 2 ranks × micro-batch 2: no accumulation)
    "DDP": (),
    "DDP, 2 micro-batches": ("optim.global_batch=8",),
    "DDP bf16 autocast": ("precision.dtype='bf16'",),
    "DDP + recompute": ("parallel.activation_checkpointing=true",),
    "FSDP2 (ZeRO-3)": ("parallel.strategy='fsdp'",),
    "FSDP2 no reshard (ZeRO-2)": (
        "parallel.strategy='fsdp'",
        "parallel.reshard_after_forward=false",
    ),  # fmt: skip
    "FSDP2 + recompute": ("parallel.strategy='fsdp'", "parallel.activation_checkpointing=true"),
    "pipeline 1F1B, 4 micro-batches": ("parallel.pipeline_stages=2", "optim.global_batch=8"),
    "pipeline GPipe, 4 micro-batches": (
        "parallel.pipeline_stages=2",
        "optim.global_batch=8",
        "parallel.pipeline_schedule='gpipe'",
    ),  # fmt: skip
}
MODELS = {"tiny": 256, "small": 256}  # preset: sequence length
MB = 1e6


def run_config(data: Path, preset: str, seq_len: int, *overrides: str) -> dict:
    cfg = {
        "model": {"preset": preset},
        "data": {"path": str(data), "seq_len": seq_len},
        "optim": {"global_batch": 4, "micro_batch": 2, "max_steps": 100},
        "checkpoint": {"every": 1000},
    }
    for item in overrides:
        config.apply_override(cfg, item)
    return cfg


def planned_peak(cfg: dict) -> tuple[float, str]:
    run = config.parse(cfg)
    spec = PRESETS[run.model.preset]
    stage = estimate_training_memory(spec, planner_setup(run, WORLD)).stage
    return stage.peak_bytes, stage.peak_phase


def main(models: dict[str, int]) -> int:
    header = (f"{'model':6} {'layout':32} | {'measured (per rank)':>21} {'planned':>9} "
              f"{'ratio':>6}  {'planned peak at':16}")  # fmt: skip
    print(header)
    print("-" * len(header))
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for preset, seq_len in models.items():
            spec = PRESETS[preset]
            data = write_random_dataset(Path(tmp) / preset, spec.vocab_size, 200_000)
            cfgs = {n: run_config(data, preset, seq_len, *o) for n, o in LAYOUTS.items()}
            t0 = time.perf_counter()
            peaks = measure_rank_peaks(list(cfgs.values()), WORLD)
            elapsed = time.perf_counter() - t0
            for (name, cfg), ranks in zip(cfgs.items(), peaks, strict=True):
                planned, phase = planned_peak(cfg)
                ratio = planned / max(ranks)
                worst = max(worst, abs(ratio - 1))
                measured = " / ".join(f"{r / MB:.1f}" for r in ranks)
                print(f"{preset:6} {name:32} | {measured:>19} M {planned / MB:8.1f}M "
                      f"{ratio:6.3f}  {phase:16}")  # fmt: skip
            print(f"       ({len(cfgs)} layouts measured in {elapsed:.0f} s)")
    print(f"\nworst planned/measured error: {worst:.1%} (target: within 10%)")
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main({"tiny": 256} if "--quick" in sys.argv else MODELS))
