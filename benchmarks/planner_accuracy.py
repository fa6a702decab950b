"""Estimated vs measured training memory for the `tiny` and `small` presets on this machine.

For each case, one training step of our decoder (forward, cross-entropy, backward, AdamW
step) is profiled on CPU (`gpucloud.train.memory_probe`), and its peak of live bytes is
printed next to the planner's estimate (`memory.estimate_training_memory`) and next to a
baseline: the same estimate with the saved activations taken from Korthikanti et al.'s
formula instead of our component-wise count. The last two columns compare the saved
activations alone (what the forward pass leaves alive, minus the log-softmax and,
under autocast, its cached 16-bit weight copies).
Ratios are estimate / measured.

Run: .venv/bin/python benchmarks/planner_accuracy.py [--quick]
"""

from __future__ import annotations

import sys
import time

from gpucloud import hardware
from gpucloud.models.presets import PRESETS
from gpucloud.planner.memory import estimate_training_memory, uncast_params
from gpucloud.planner.setup import TrainSetup
from gpucloud.train.memory_probe import measure_training_step

CASES = [
    # preset, micro-batch, seq-len, recompute, precision
    ("tiny", 1, 128, "none", "fp32"),
    ("tiny", 4, 512, "none", "fp32"),
    ("tiny", 8, 1024, "none", "fp32"),
    ("tiny", 4, 512, "full", "fp32"),
    ("tiny", 4, 512, "none", "pure-bf16"),
    ("tiny", 4, 512, "none", "bf16"),
    ("small", 1, 256, "none", "fp32"),
    ("small", 4, 512, "none", "fp32"),
    ("small", 2, 1024, "none", "fp32"),
    ("small", 4, 512, "full", "fp32"),
    ("small", 2, 512, "none", "pure-bf16"),
    ("small", 2, 512, "full", "pure-bf16"),
    ("small", 2, 512, "none", "bf16"),  # DDP mixed precision: fp32 weights under autocast
]
MEASURED_DTYPE = {"fp32": "fp32", "pure-bf16": "bf16", "bf16": "autocast-bf16"}
QUICK = [c for c in CASES if c[0] == "tiny"] + [CASES[5], CASES[-1]]
MB = 1e6


def main(cases: list[tuple]) -> int:
    header = (
        f"{'preset':6} {'b×s':>9} {'recompute':9} {'precision':9} | {'measured':>9} "
        f"{'estimate':>9} {'ratio':>6} {'phase':>16} | {'Korthikanti':>11} {'ratio':>6} | "
        f"{'saved activations: ours':>23} {'Korthikanti':>11}"
    )
    print(header)
    print("-" * len(header))
    worst = 0.0
    for name, batch, seq, recompute, precision in cases:
        spec = PRESETS[name]
        dtype = MEASURED_DTYPE[precision]
        t0 = time.perf_counter()
        measured = measure_training_step(spec, batch, seq, recompute, dtype)
        elapsed = time.perf_counter() - t0
        setup = TrainSetup(hardware.get("H100-SXM"), precision=precision, micro_batch=batch,
                           seq_len=seq, recompute=recompute)  # fmt: skip
        est = estimate_training_memory(spec, setup)
        stage = est.stage
        # Baseline: the same peak with Korthikanti's activations in place of our count.
        swap = est.korthikanti_activations_bytes - stage.activations_bytes
        kort = max(v + swap if k != "optimizer step" else v for k, v in stage.phases.items())
        ratio = stage.peak_bytes / measured.peak_bytes
        # What the forward pass leaves alive, minus the log-softmax (exact size).
        held = batch * seq * spec.vocab_size * 4
        casts = 2 * (spec.num_params - uncast_params(spec, 1, "all")) if setup.autocast else 0
        saved = measured.after_forward_bytes - measured.states_bytes - held - casts
        worst = max(worst, abs(ratio - 1))
        print(
            f"{name:6} {f'{batch}×{seq}':>9} {recompute:9} {precision:9} | "
            f"{measured.peak_bytes / MB:8.1f}M {stage.peak_bytes / MB:8.1f}M {ratio:6.3f} "
            f"{stage.peak_phase:>16} | {kort / MB:10.1f}M {kort / measured.peak_bytes:6.3f} | "
            f"{stage.activations_bytes / saved:23.3f} "
            f"{est.korthikanti_activations_bytes / saved:11.3f}   ({elapsed:.1f}s)"
        )
    print(f"\nworst estimate error: {worst:.2%} (target: within 10%)")
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main(QUICK if "--quick" in sys.argv else CASES))
