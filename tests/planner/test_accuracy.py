"""The training-memory estimate against the peak the torch profiler measures on this CPU.

Tolerance: 2% of the peak. The estimate counts our decoder's saved tensors one by one, so
on this machine it lands within 0.2% whenever the peak is the start of backward or the
optimizer step (fp32 and pure bf16, with and without checkpointing). 2% keeps the test
meaningful — Korthikanti's formula misses by 10-40% here — while leaving room for a torch
release that saves one more small per-token tensor.

One case gets 5%: full recomputation in pure bf16 of a model whose peak is the recomputed
layer's backward. There the recomputed forward leaves a few more hidden-size tensors alive
than the count models (measured: 1-4% low); the `tiny` and `small` presets never peak there.
"""

import pytest

from gpucloud import hardware
from gpucloud.models.presets import PRESETS
from gpucloud.models.spec import ModelSpec
from gpucloud.planner.memory import estimate_training_memory
from gpucloud.planner.setup import TrainSetup
from gpucloud.train.memory_probe import measure_training_step

TOLERANCE = 0.02
# `tiny` is dominated by its logits (vocab 2048, hidden 64); `layers` is a narrow-vocab
# model whose peak is mostly what the decoder layers save. The benchmark adds `small`.
LAYERS = ModelSpec("layers", "llama", vocab_size=256, hidden_size=128, intermediate_size=352,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
SPECS = {"tiny": PRESETS["tiny"], "layers": LAYERS}
CASES = [
    # model, micro-batch, seq-len, recompute, precision
    ("tiny", 2, 256, "none", "fp32"),
    ("tiny", 4, 128, "full", "fp32"),
    ("tiny", 2, 192, "none", "pure-bf16"),
    ("layers", 2, 256, "none", "fp32"),
    ("layers", 4, 128, "full", "fp32"),
    ("layers", 2, 256, "none", "pure-bf16"),
    ("layers", 2, 128, "full", "pure-bf16"),
    # bf16 with ZeRO-0 is DDP under torch.autocast: fp32 weights, 16-bit matmuls.
    ("tiny", 2, 256, "none", "bf16"),
    ("layers", 2, 256, "none", "bf16"),
    ("layers", 2, 256, "full", "bf16"),
]
MEASURED_DTYPE = {"fp32": "fp32", "pure-bf16": "bf16", "bf16": "autocast-bf16"}


def _estimate(name, batch, seq, recompute, precision):
    setup = TrainSetup(hardware.get("H100-SXM"), precision=precision, micro_batch=batch,
                       seq_len=seq, recompute=recompute)  # fmt: skip
    return estimate_training_memory(SPECS[name], setup)


@pytest.mark.parametrize(("name", "batch", "seq", "recompute", "precision"), CASES)
def test_estimated_training_peak_matches_the_profiler(name, batch, seq, recompute, precision):
    dtype = MEASURED_DTYPE[precision]
    measured = measure_training_step(SPECS[name], batch, seq, recompute, dtype)
    est = _estimate(name, batch, seq, recompute, precision).stage
    # Model states are exact; the peak (states + activations + cross-entropy) within 2%.
    # (Under autocast the ZeRO paper's 16-bit parameters are autocast's cached casts, so
    # only the peak compares.)
    if dtype != "autocast-bf16":
        assert est.params_bytes == measured.params_bytes
        assert est.master_bytes + est.optimizer_bytes == pytest.approx(
            measured.optimizer_bytes, abs=1024
        )  # Adam's step counters are 4-8 bytes per tensor
    recomputed_bf16 = est.peak_phase == "recomputed layer" and precision == "pure-bf16"
    tolerance = 0.05 if recomputed_bf16 else TOLERANCE
    assert est.peak_bytes == pytest.approx(measured.peak_bytes, rel=tolerance)
    measured_phase = max(measured.phase_peak_bytes, key=measured.phase_peak_bytes.get)
    expected_phase = {
        "backward start": "backward",
        "recomputed layer": "backward",
        "optimizer step": "optimizer",
    }
    assert expected_phase[est.peak_phase] == measured_phase


def test_saved_activations_match_what_the_forward_pass_leaves_alive():
    measured = measure_training_step(LAYERS, 2, 256, "none", "fp32")
    est = _estimate("layers", 2, 256, "none", "fp32")
    held = 2 * 256 * LAYERS.vocab_size * 4  # the log-softmax (the logits die in forward)
    alive = measured.after_forward_bytes - measured.states_bytes
    assert est.stage.activations_bytes + held == pytest.approx(alive, rel=0.005)
    assert est.stage.activations_bytes > 4 * held  # the layers, not the logits, dominate
    # Korthikanti's count ignores what fp32 norms save and the scores it counts are never
    # stored: off by far more than the component-wise count.
    kort = est.korthikanti_activations_bytes
    assert abs(kort + held - alive) > 10 * abs(est.stage.activations_bytes + held - alive)
