"""Model states against the ZeRO paper and DeepSpeed's estimators; the transient lines."""

import pytest

from gpucloud import hardware
from gpucloud.models.presets import PRESETS
from gpucloud.models.spec import ModelSpec
from gpucloud.planner import activations as act
from gpucloud.planner.memory import (
    deepspeed_estimate,
    deepspeed_largest_layer,
    estimate_training_memory,
    stage_params,
)
from gpucloud.planner.setup import TrainSetup

H100 = hardware.get("H100-SXM")
LLAMA7 = PRESETS["llama-2-7b"]


def states(spec=LLAMA7, **kw):
    setup = TrainSetup(H100, **{"gpus_per_node": 8, **kw})
    setup.check(spec)
    return estimate_training_memory(spec, setup)


@pytest.mark.parametrize("n", [8, 16, 64])
def test_mixed_precision_adam_model_states_follow_the_zero_paper(n):
    phi = LLAMA7.num_params
    paper = {0: 16 * phi, 1: 4 * phi + 12 * phi / n, 2: 2 * phi + 14 * phi / n, 3: 16 * phi / n}
    for zero, expected in paper.items():
        m = states(nodes=n // 8, zero=zero, precision="bf16")
        assert m.stage.model_states_bytes == pytest.approx(expected, rel=1e-12)
        assert m.zero_paper_bytes == pytest.approx(expected, rel=1e-12)


def test_zero_formulas_name_the_convention():
    formulas = [states(zero=z).zero_paper_formula for z in range(4)]
    assert formulas == ["16Φ", "4Φ + 12Φ/N", "2Φ + 14Φ/N", "16Φ/N"]


@pytest.mark.parametrize(
    ("precision", "optimizer", "bytes_per_param"),
    [
        ("fp32", "adamw", 16),
        ("pure-bf16", "adamw", 8),
        ("bf16", "sgd", 12),
        ("fp32", "sgd", 12),
        ("bf16", "adam8bit", 10 + 2 * 4 / 256),
        ("pure-bf16", "adam8bit", 6 + 2 * 4 / 256),
    ],
)
def test_precision_and_optimizer_bytes_per_parameter(precision, optimizer, bytes_per_param):
    m = states(gpus_per_node=1, precision=precision, optimizer=optimizer)
    assert m.stage.model_states_bytes == pytest.approx(bytes_per_param * LLAMA7.num_params)


def test_deepspeed_estimators_count_18_bytes_and_the_largest_layer():
    phi, world = LLAMA7.num_params, 8
    largest = deepspeed_largest_layer(LLAMA7)
    assert largest == 32000 * 4096  # embeddings beat any single linear of Llama-2-7B
    assert deepspeed_estimate(phi, largest, 3, world, False) == 4 * largest + int(18 * phi / 8)
    assert deepspeed_estimate(phi, largest, 3, world, True) == 4 * largest + int(2 * phi / 8)
    assert deepspeed_estimate(phi, largest, 2, world, False) == 4 * phi + int(16 * phi / 8)
    assert deepspeed_estimate(phi, largest, 1, world, True) == 2 * phi
    assert deepspeed_estimate(phi, largest, 0, world, False) is None
    m = states(zero=3)
    assert m.deepspeed_estimator_bytes > m.zero_paper_bytes  # 18 B/param vs 16


def test_offload_moves_master_and_optimizer_states_to_the_host():
    on_gpu, offloaded = states(zero=2), states(zero=2, offload_optimizer=True)
    assert offloaded.stage.master_bytes == offloaded.stage.optimizer_bytes == 0
    moved = on_gpu.stage.master_bytes + on_gpu.stage.optimizer_bytes
    assert offloaded.host_offload_bytes_per_node == pytest.approx(8 * moved)
    assert offloaded.total_bytes < on_gpu.total_bytes


def test_tensor_and_pipeline_parallelism_divide_the_model_states():
    base = states(zero=1).stage.model_states_bytes
    tp2 = states(zero=1, tp=2).stage.model_states_bytes  # dp halves too: 2·2Φ/2 + 12Φ/(2·4)
    phi = LLAMA7.num_params
    assert tp2 == pytest.approx(4 * phi / 2 + 12 * phi / 2 / 4)
    assert tp2 < base
    first = stage_params(LLAMA7, 4, "first")
    last = stage_params(LLAMA7, 4, "last")
    middle = 2 * 8 * LLAMA7.params_per_layer
    assert first + middle + last == LLAMA7.num_params


def test_pipeline_first_stage_holds_pp_micro_batches_of_activations():
    m = states(pp=4, micro_batch=1, seq_len=4096, grad_accum=8)
    assert m.stage.stage == "first"  # 4 micro-batches in flight outweigh the logits
    per_layer = act.decoder_layer_bytes(LLAMA7, 2, autocast=True)  # bf16 DDP: autocast
    assert m.stage.activations_bytes == pytest.approx(4 * 4096 * 8 * per_layer, rel=1e-9)
    assert m.stage.logits_bytes == 0  # the LM head lives on the last stage
    # Fewer micro-batches than stages: no more in flight than there are.
    two = states(pp=4, micro_batch=1, seq_len=4096, grad_accum=2, zero=0)
    assert two.stage.activations_bytes == pytest.approx(2 * 4096 * 8 * per_layer, rel=1e-9)
    # GPipe holds every micro-batch on every stage, the last one's losses too.
    gpipe = states(pp=4, micro_batch=1, seq_len=4096, grad_accum=8, pipeline_schedule="gpipe")
    assert gpipe.stage.activations_bytes > 1.9 * m.stage.activations_bytes


def test_moe_counts_every_expert_for_memory():
    mixtral = PRESETS["mixtral-8x7b"]
    m = states(mixtral, gpus_per_node=8, zero=3)
    assert m.stage.params_bytes == pytest.approx(2 * mixtral.num_params / 8)
    assert mixtral.num_active_params < mixtral.num_params / 3
    # Same shape as Mistral-7B, but every token runs through two experts' MLPs.
    extra = act.decoder_layer_bytes(mixtral, 2) - act.decoder_layer_bytes(PRESETS["mistral-7b"], 2)
    assert extra == 4 * 2 * mixtral.intermediate_size


def test_a_model_that_does_not_fit_reports_the_shortfall():
    m = states(gpus_per_node=1, zero=0, seq_len=4096)
    assert not m.fits
    assert m.shortfall_bytes == pytest.approx(m.total_bytes - H100.memory_bytes)
    assert m.stage.peak_bytes >= m.stage.model_states_bytes


def test_the_peak_is_the_largest_phase_and_overheads_are_separate():
    m = states(zero=3, seq_len=4096, recompute="full")
    s = m.stage
    assert set(s.phases) == {"backward start", "optimizer step", "recomputed layer"}
    assert s.peak_bytes == max(s.phases.values())
    assert m.total_bytes == pytest.approx(s.peak_bytes * 1.05 + 2**30)
    # Two layers (current + prefetched) and FSDP2's root group: embeddings, norm, LM head.
    root = LLAMA7.num_params - LLAMA7.num_hidden_layers * LLAMA7.params_per_layer
    assert s.gathered_bytes == (2 * LLAMA7.params_per_layer + root) * 2


def test_korthikanti_adaptation_is_the_paper_minus_dropout():
    # An MHA layer with i = 2h: SwiGLU's gate, up, silu and product (4i = 8h) are exactly
    # GeLU's 4h input and 4h output, so the only difference left is dropout: masks (1 byte
    # after attention and after the MLP) and the s² dropout mask + output of the scores.
    spec = ModelSpec("gpt", "llama", vocab_size=1000, hidden_size=256, intermediate_size=512,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    s, h, a = 128, 256, 4
    adapted = act.korthikanti_layer_bytes(spec, s, act_bytes=2)
    assert act.korthikanti_original_layer_bytes(spec, s) - adapted == 2 * h + 3 * a * s
    selective = act.korthikanti_layer_bytes(spec, s, 2, "selective")
    assert adapted - selective == 2 * a * s
    assert act.korthikanti_layer_bytes(spec, s, 2, "full") == 2 * h


def test_autocast_keeps_the_residual_stream_in_fp32_and_saves_casts():
    # DDP runs bf16 under torch.autocast: per layer, five 16-bit casts of hidden-size
    # inputs (q, k, v, gate, up) on top of the pure-bf16 count. FSDP casts the weights.
    spec = PRESETS["llama-3-8b"]
    extra = act.decoder_layer_bytes(spec, 2, autocast=True) - act.decoder_layer_bytes(spec, 2)
    assert extra == 5 * 2 * spec.hidden_size
    assert TrainSetup(H100, zero=1, precision="bf16").autocast
    assert not TrainSetup(H100, zero=2, precision="bf16").autocast
    assert not TrainSetup(H100, zero=0, precision="pure-bf16").autocast


def test_tensor_parallel_splits_hidden_tensors_only_with_sequence_parallel():
    spec = PRESETS["llama-3-8b"]
    full = act.decoder_layer_bytes(spec, 2)
    tp = act.decoder_layer_bytes(spec, 2, tp=4)
    sp = act.decoder_layer_bytes(spec, 2, tp=4, sp=True)
    assert sp < tp < full
    rope = 4 * 2 * spec.head_dim  # cast cos/sin broadcast over heads: never split
    norms = 2 * act.norm_bytes(spec.hidden_size, 2)
    assert tp - norms - rope == pytest.approx((full - norms - rope) / 4)
    assert sp - rope == pytest.approx((full - rope) / 4, rel=1e-3)
