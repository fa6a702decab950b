"""Draft-model speculative decoding: greedy output identical to decoding without it
(prefix caching on and off, chunked prefill, a pool small enough to preempt), the draft's
K/V bookkeeping, and the refusal of a draft of another vocabulary."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from serve_helpers import run_engine

from gpucloud.errors import ConfigError
from gpucloud.models.draft import check_draft, first_layers
from gpucloud.models.llama import LlamaForCausalLM
from gpucloud.models.presets import PRESETS
from gpucloud.serve import EngineConfig, LLMEngine, SamplingParams
from gpucloud.serve.spec_policy import GuessPolicy

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    """float64 (batch shape cannot flip an argmax), and an init wide enough that a 1-layer
    draft is right often but not always."""
    model = LlamaForCausalLM(PRESETS["tiny"])
    model.init_weights(0, std=0.1)
    return model.double().eval()


@pytest.fixture(scope="module")
def draft(model) -> LlamaForCausalLM:
    return first_layers(model, 1)


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    random = [torch.randint(3, 2048, (n,), generator=gen).tolist() for n in (5, 17, 40, 1)]
    shared = torch.randint(3, 2048, (20,), generator=gen).tolist()
    return random + [shared + p for p in random[:3]]


def engine(model, draft=None, priced=False, **config) -> LLMEngine:
    """Without `priced`, guesses cost the policy no draft forward (as with a draft many
    times smaller than its target): the 1-layer stand-in of this 2-layer target costs 0.9 of
    a step, and would rightly stop guessing before the K/V bookkeeping is put to work."""
    config = {"kv_cache_bytes": 1 << 22, "block_size": 4, **config}
    if draft is not None:
        config |= {"speculative": "draft", "num_speculative_tokens": 4}
    e = LLMEngine(model, None, EngineConfig(**config), draft)
    if draft is not None and not priced:
        e.guess_policy = GuessPolicy(4, draft_cost=0.0)
    return e


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def want(model, prompts):
    return tokens(run_engine(engine(model), prompts, GREEDY))


@pytest.mark.parametrize(
    "config",
    [{}, {"enable_prefix_caching": False}, {"max_num_batched_tokens": 16, "max_num_seqs": 3}],
    ids=["default", "no-prefix-caching", "chunked-prefill+prefix-hits"],
)
def test_greedy_output_is_identical_with_a_draft_model(model, draft, prompts, want, config):
    e = engine(model, draft, **config)
    assert tokens(run_engine(e, prompts, GREEDY)) == want
    s = e.stats()
    assert 0 < s.accepted_tokens < s.draft_tokens  # guesses held and failed
    assert s.num_steps < sum(len(t) for t in want)  # fewer steps than one per token
    assert e.blocks.num_free == e.blocks.num_blocks


def test_a_preempting_pool_keeps_the_output(model, draft, prompts, want):
    per_token = model.spec.kv_bytes_per_token(8) + draft.spec.kv_bytes_per_token(8)
    e = engine(model, draft, kv_cache_bytes=120 * per_token)
    assert e.capacity_tokens == 120  # the draft's K/V shares the budget, block for block
    assert tokens(run_engine(e, prompts, GREEDY)) == want
    assert e.stats().num_preemptions > 0 and e.stats().accepted_tokens > 0


def test_the_draft_never_trusts_kv_past_the_confirmed_tokens(model, draft, prompts):
    e = engine(model, draft)
    for p in prompts:
        e.add_request(p, GREEDY)
    while e.has_unfinished():
        e.step()
        for seq in e.scheduler.running:
            assert seq.draft_computed_tokens <= seq.num_computed_tokens
    assert e.stats().accepted_tokens > 0


def test_a_draft_of_another_vocabulary_is_refused(model):
    other = LlamaForCausalLM(replace(PRESETS["tiny"], vocab_size=1024)).double().eval()
    with pytest.raises(ConfigError, match="vocabulary of 1024 tokens"):
        engine(model, first_layers(other, 1))
    with pytest.raises(ConfigError, match="another tokenizer"):
        check_draft(model, model, {"a": 0}, {"b": 0})
    with pytest.raises(ConfigError, match="needs a draft model"):
        LLMEngine(model, None, EngineConfig(speculative="draft", kv_cache_bytes=1 << 22))
    with pytest.raises(ConfigError, match="speculative='draft'"):
        EngineConfig(draft_model="somewhere")


def test_a_draft_that_keeps_missing_stops_guessing_and_output_stays_the_same(model, prompts, want):
    """A draft of other weights is almost never right: after its first one-token probe
    fails, each sequence guesses only in probes after growing pauses (spec_policy), where
    without the policy every step would guess 4 tokens, 4x the tokens generated."""
    stranger = LlamaForCausalLM(PRESETS["tiny"])
    stranger.init_weights(7, std=0.1)
    eng = engine(model, first_layers(stranger.double().eval(), 1), priced=True)
    assert tokens(run_engine(eng, prompts, GREEDY)) == want
    stats = eng.stats()
    assert stats.draft_tokens <= 3 * len(prompts)  # probes at 1, 6 and 23 tokens of 32
