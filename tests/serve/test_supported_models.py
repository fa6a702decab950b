"""Every row of the README's supported-models table, as a tiny random model built and saved by
transformers itself: our loader reads its config (both dialects) and weights, and the model
and the serving engine give transformers' logits and greedy tokens, whatever the engine does
with the batch (prefix caching, chunked prefill, preemption under a tiny KV pool)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hf_families import ROWS, VOCAB, build, hf_generate, legacy_copy
from serve_helpers import engine_for, run_engine

from gpucloud.models.loader import load_model
from gpucloud.models.spec import ModelSpec
from gpucloud.serve import SamplingParams

NEW_TOKENS = 8
LOGIT_ATOL = 1e-9  # float64 on both sides: only summation order differs
LOGPROB_ATOL = 1e-5  # the engine hands the sampler fp32 logits
# short; long (past the sliding windows and the RoPE scalings' original length); the long
# prompt's first 40 tokens with another tail, so the prefix cache has something to reuse.
_gen = torch.Generator().manual_seed(7)
SHORT = torch.randint(3, VOCAB, (5,), generator=_gen).tolist()
LONG = torch.randint(3, VOCAB, (70,), generator=_gen).tolist()
PROMPTS = [SHORT, LONG, LONG[:40] + torch.randint(3, VOCAB, (21,), generator=_gen).tolist()]


@pytest.fixture(scope="module", params=ROWS, ids=lambda r: r.name)
def case(request, tmp_path_factory):
    row = request.param
    model_dir = tmp_path_factory.mktemp(row.name) / "hf"
    hf = build(row, model_dir).to(torch.float64)
    ours = load_model(model_dir).to(torch.float64)
    return row, model_dir, hf, ours, hf_generate(hf, PROMPTS, NEW_TOKENS)


def _last_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        out = model(torch.tensor([prompt]))
    return (out if isinstance(out, torch.Tensor) else out.logits)[0, -1]


def test_loaded_model_gives_transformers_logits(case):
    row, _, hf, ours, _ = case
    assert ours.spec.num_params == sum(p.numel() for p in hf.parameters())
    for prompt in (SHORT, LONG):
        error = (_last_logits(ours, prompt) - _last_logits(hf, prompt)).abs().max().item()
        assert error < LOGIT_ATOL, (row.name, len(prompt), error)


def test_legacy_config_dialect_reads_the_same(case, tmp_path):
    row, model_dir, hf, _, _ = case
    legacy = legacy_copy(model_dir, tmp_path / "legacy")
    assert "rope_parameters" not in (legacy / "config.json").read_text()
    spec = ModelSpec.from_dir(legacy)
    assert replace(spec, name="x") == replace(ModelSpec.from_dir(model_dir), name="x")
    ours = load_model(legacy).to(torch.float64)
    error = (_last_logits(ours, LONG) - _last_logits(hf, LONG)).abs().max().item()
    assert error < LOGIT_ATOL, (row.name, error)


def _kv_bytes(spec: ModelSpec, tokens: int) -> int:
    return int(spec.kv_bytes_per_token(8) * tokens)


# name: engine config; "tiny" pools hold the longest request alone, not the batch.
SETUPS = {
    "normal-cache": dict(enable_prefix_caching=True),
    "normal-nocache-chunked": dict(enable_prefix_caching=False, max_num_batched_tokens=16),
    "tiny-cache-chunked": dict(enable_prefix_caching=True, max_num_batched_tokens=16, tiny=True),
    "tiny-nocache": dict(enable_prefix_caching=False, tiny=True),
}


@pytest.mark.parametrize("setup", SETUPS)
def test_engine_gives_transformers_tokens_and_logprobs(case, setup):
    row, _, _, ours, want = case
    config = dict(SETUPS[setup])
    if config.pop("tiny", False):
        config["kv_cache_bytes"] = _kv_bytes(ours.spec, len(LONG) + NEW_TOKENS + 8)
    engine = engine_for(ours, block_size=4, max_num_seqs=2, **config)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    outs = run_engine(engine, PROMPTS, params)
    for out, (tokens, logprobs) in zip(outs, want, strict=True):
        got = out.outputs[0]
        assert got.token_ids == tokens, row.name
        for step, lp in enumerate(got.logprobs):
            for token, value in lp.top.items():
                assert abs(value - logprobs[step, token].item()) < LOGPROB_ATOL, (row.name, step)
    stats = engine.stats()
    assert (stats.prefix_cache_hit_rate > 0) == config["enable_prefix_caching"]
    assert (stats.num_preemptions > 0) == ("kv_cache_bytes" in config)
    if "max_num_batched_tokens" in config:  # the long prompts took several steps
        assert stats.num_steps > NEW_TOKENS + len(LONG) // 16
    assert engine.blocks.num_free == engine.blocks.num_blocks
