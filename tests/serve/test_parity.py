"""Greedy outputs are token-identical to transformers' generate, whatever the engine does
with the batch: prefix caching, chunked prefill, preemption under a tiny KV pool."""

from __future__ import annotations

import pytest
import torch
from serve_helpers import engine_for, hf_greedy, hf_twin, random_model, run_engine

from gpucloud.serve import SamplingParams

NEW_TOKENS = 24
LENGTHS = [5, 17, 33, 64, 1, 100, 48]


def _prompts(vocab: int, shared_prefix: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, vocab, (shared_prefix,), generator=gen).tolist()
    return [prefix + torch.randint(3, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def tiny():
    # float64: batching changes summation order; at fp64 no argmax can flip because of it.
    model = random_model("tiny", torch.float64)
    prompts = _prompts(model.spec.vocab_size, shared_prefix=20)
    return model, prompts, hf_greedy(hf_twin(model), prompts, NEW_TOKENS)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_prefix_caching_on_and_off_match_transformers(tiny):
    model, prompts, want = tiny
    for caching in (True, False):
        # Two at a time: later requests arrive after the shared prefix is in the cache.
        engine = engine_for(model, block_size=4, max_num_seqs=2, enable_prefix_caching=caching)
        assert _tokens(run_engine(engine, prompts, GREEDY)) == want
        hit_rate = engine.stats().prefix_cache_hit_rate
        assert (hit_rate > 0) == caching  # the shared 20-token prefix was reused


def test_prefix_cache_hits_on_a_second_pass_still_match(tiny):
    model, prompts, want = tiny
    engine = engine_for(model, block_size=4)
    run_engine(engine, prompts, GREEDY)
    before = engine.blocks.hit_tokens
    outs = run_engine(engine, prompts, GREEDY)
    assert _tokens(outs) == want
    assert engine.blocks.hit_tokens - before >= sum(len(p) - 4 for p in prompts)
    assert all(o.num_cached_tokens > 0 for o in outs if len(o.prompt_token_ids) > 8)


def test_chunked_prefill_matches_transformers(tiny):
    model, prompts, want = tiny
    engine = engine_for(model, block_size=4, max_num_batched_tokens=16)
    assert _tokens(run_engine(engine, prompts, GREEDY)) == want
    assert engine.stats().num_steps > NEW_TOKENS + 10  # 100-token prompts took several steps


def test_tiny_pool_preempts_and_still_matches_transformers(tiny):
    model, prompts, want = tiny
    per_token = model.spec.kv_bytes_per_token(8)
    for caching in (True, False):
        # 160 tokens of KV: the longest request (120 + 24) fits alone, the batch does not.
        engine = engine_for(model, block_size=4, kv_cache_bytes=160 * per_token,
                            enable_prefix_caching=caching)  # fmt: skip
        assert _tokens(run_engine(engine, prompts, GREEDY)) == want
        assert engine.stats().num_preemptions > 0
        assert engine.blocks.num_free == engine.blocks.num_blocks  # every block came back


def test_small_preset_fp32_matches_transformers():
    model = random_model("small", torch.float32)
    prompts = _prompts(model.spec.vocab_size)[1:4]
    want = hf_greedy(hf_twin(model), prompts, 8)
    engine = engine_for(model, kv_cache_bytes=16 << 20, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert _tokens(run_engine(engine, prompts, params)) == want
