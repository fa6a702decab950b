"""Serving memory (weights, KV cache, concurrency) and serving speed and cost."""

import math

import pytest

from gpucloud import hardware
from gpucloud.errors import UserError
from gpucloud.models.presets import PRESETS
from gpucloud.planner import ServeSetup, estimate_inference
from gpucloud.planner.inference import weights_bytes

LLAMA3 = PRESETS["llama-3-8b"]
L40S = hardware.get("L40S")


def test_kv_bytes_per_token_is_two_layers_kv_heads_head_dim_bytes():
    plan = estimate_inference(LLAMA3, ServeSetup(L40S, quant="bf16", max_seq_len=8192))
    assert plan.memory.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    fp8 = estimate_inference(LLAMA3, ServeSetup(L40S, kv_dtype="fp8"))
    assert fp8.memory.kv_bytes_per_token == 65536


def test_quantized_weights_keep_embeddings_in_16_bit_and_pay_for_group_scales():
    n = LLAMA3.num_params
    assert weights_bytes(LLAMA3, "bf16") == 2 * n
    assert weights_bytes(LLAMA3, "fp32") == 4 * n
    vocab = 2 * 128256 * 4096
    norms = 65 * 4096
    linear = n - vocab - norms
    assert weights_bytes(LLAMA3, "int4") == pytest.approx(
        linear * (0.5 + 2.5 / 128) + 2 * (vocab + norms)
    )
    assert weights_bytes(LLAMA3, "int8") < weights_bytes(LLAMA3, "bf16") * 0.6


def test_cache_takes_what_the_memory_fraction_leaves_in_whole_blocks():
    setup = ServeSetup(L40S, quant="int4", max_seq_len=8192, tp=1)
    m = estimate_inference(LLAMA3, setup).memory
    left = 0.9 * L40S.memory_bytes - m.weights_per_gpu_bytes - m.workspace_bytes - 2**30
    assert m.kv_cache_bytes == pytest.approx(left)
    assert m.max_tokens_in_cache == math.floor(left / (131072 * 16)) * 16
    assert m.max_concurrent_seqs == m.max_tokens_in_cache // 8192
    assert m.max_concurrent_seqs > 20  # 8B int4 on a 48 GB card: dozens of 8k sequences
    assert m.fits


def test_tensor_parallel_splits_weights_and_kv_heads_and_replicates_beyond_them():
    one = estimate_inference(LLAMA3, ServeSetup(L40S, tp=1)).memory
    four = estimate_inference(LLAMA3, ServeSetup(L40S, tp=4)).memory
    norms = (2 * 32 + 1) * 4096 * 2  # bf16 RMSNorm weights: every rank holds them whole
    assert four.weights_per_gpu_bytes == (one.weights_per_gpu_bytes - norms) / 4 + norms
    assert four.kv_bytes_per_token_per_gpu == one.kv_bytes_per_token_per_gpu / 4
    assert four.max_tokens_in_cache > 4 * one.max_tokens_in_cache
    small = PRESETS["small"]  # 2 KV heads: at tp=4 each GPU keeps one
    m = estimate_inference(small, ServeSetup(L40S, tp=4)).memory
    assert m.kv_bytes_per_token_per_gpu == m.kv_bytes_per_token / 2


def test_a_model_too_large_reports_fits_false_and_the_shortfall():
    plan = estimate_inference(PRESETS["llama-3-70b"], ServeSetup(hardware.get("L4")))
    assert not plan.fits
    assert plan.memory.max_concurrent_seqs == 0
    assert plan.memory.shortfall_bytes == pytest.approx(
        plan.memory.required_bytes - 0.9 * hardware.get("L4").memory_bytes
    )
    assert plan.memory.shortfall_bytes > 100e9  # 141 GB of bf16 weights on a 24 GB card


def test_decode_speed_bounds():
    setup = ServeSetup(L40S, quant="bf16", max_seq_len=4096)
    plan = estimate_inference(LLAMA3, setup)
    s, m = plan.speed, plan.memory
    one_seq = m.weights_bytes + m.kv_bytes_per_token * 2048
    assert s.decode_tokens_per_s_batch1 == pytest.approx(L40S.memory_bandwidth / one_seq)
    assert s.decode_tokens_per_s_batch1 < s.decode_tokens_per_s <= s.decode_tokens_per_s_flops_bound
    assert s.batch == m.max_concurrent_seqs  # no --concurrency: the cache full
    assert plan.cost.usd_per_hour == L40S.price_per_hour
    per_million = L40S.price_per_hour / (s.decode_tokens_per_s * 3600) * 1e6
    assert plan.cost.usd_per_million_tokens == pytest.approx(per_million)


def test_moe_batch_one_reads_only_active_experts():
    mixtral = PRESETS["mixtral-8x7b"]
    h200 = hardware.get("H200")
    s = estimate_inference(mixtral, ServeSetup(h200, max_seq_len=1024)).speed
    dense_bound = h200.memory_bandwidth / weights_bytes(mixtral, "bf16")
    assert s.decode_tokens_per_s_batch1 > 2.5 * dense_bound


def test_bad_serving_input_names_what_is_allowed():
    with pytest.raises(UserError, match="--quant must be one of fp32, bf16, fp16, fp8"):
        ServeSetup(L40S, quant="int3")
    with pytest.raises(UserError, match="A100-80GB has no fp8"):
        ServeSetup(hardware.get("A100-80GB"), quant="fp8")
    with pytest.raises(UserError, match="--tp 3 must divide the 32 attention heads"):
        estimate_inference(LLAMA3, ServeSetup(L40S, tp=3))
    with pytest.raises(UserError, match="--concurrency must be a positive integer"):
        ServeSetup(L40S, concurrency=0)
