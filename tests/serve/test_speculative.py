"""Speculative decoding: n-gram proposals, and greedy output identical to decoding without
them whatever the engine does with the batch (prefix caching, chunked prefill, preemption,
stops and max_tokens cutting an accepted run, logprobs)."""

from __future__ import annotations

import pytest
import torch
from serve_helpers import engine_for, run_engine

from gpucloud.errors import ConfigError
from gpucloud.models.llama import LlamaForCausalLM
from gpucloud.models.presets import PRESETS
from gpucloud.models.tokenizer import load_tokenizer
from gpucloud.serve import EngineConfig, SamplingParams
from gpucloud.serve.kv_cache import block_hash
from gpucloud.serve.speculative import ngram_proposal

NEW_TOKENS = 40


def test_ngram_proposal_takes_the_most_recent_longest_match():
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3]
    # "2 3" occurs at 1-2 and 5-6; the most recent one is followed by 5 6 7.
    assert ngram_proposal(tokens, 3, n_max=3, n_min=1) == [5, 6, 7]
    # "9 2 3" is a longer match than the later "2 3": it wins.
    assert ngram_proposal([*tokens, 8, 9, 2, 3], 2, n_max=3, n_min=1) == [5, 6]
    assert ngram_proposal(tokens, 3, n_max=3, n_min=3) == []  # only 2-grams recur
    assert ngram_proposal([5, 6, 7, 8], 3, n_max=3, n_min=1) == []  # nothing recurs
    assert ngram_proposal([7], 3, n_max=3, n_min=1) == []


def test_ngram_proposal_continues_a_loop_past_the_end():
    assert ngram_proposal([1, 4, 4, 4], 5, n_max=2, n_min=1) == [4, 4, 4, 4, 4]
    assert ngram_proposal([9, 1, 2, 3, 1, 2, 3], 5, n_max=3, n_min=2) == [1, 2, 3, 1, 2]


def test_bad_speculative_options_are_config_errors():
    with pytest.raises(ConfigError, match="use ngram"):
        EngineConfig(speculative="medusa")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        EngineConfig(speculative="ngram", prompt_lookup_min=3, prompt_lookup_max=2)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    """A float64 tiny model (batch shape cannot flip an argmax) whose greedy output mixes
    loops (drafts accepted) with fresh tokens (drafts rejected): a wider init than the
    default, whose outputs are one token repeated."""
    model = LlamaForCausalLM(PRESETS["tiny"])
    model.init_weights(0, std=0.1)
    return model.double().eval()


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    vocab = model.spec.vocab_size
    random = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 17, 33, 64, 1)]
    shared = torch.randint(3, vocab, (20,), generator=gen).tolist()
    repeated = [p[:9] * 5 for p in random[1:4]]  # proposals from the prompt, some wrong
    return random + repeated + [shared + p for p in random[:3]]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _run(model, prompts, params=GREEDY, tokenizer=None, **config):
    engine = engine_for(model, tokenizer, block_size=4, **config)
    return engine, run_engine(engine, prompts, params)


@pytest.fixture(scope="module")
def want(model, prompts) -> list[list[int]]:
    return _tokens(_run(model, prompts)[1])


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 16},  # chunked prefill next to verification chunks
        {"max_num_seqs": 3},  # later requests hit the prefix cache
    ],
    ids=["default", "no-prefix-caching", "chunked-prefill", "prefix-hits"],
)
def test_greedy_output_is_identical_with_ngram_speculation(model, prompts, want, config):
    engine, outs = _run(model, prompts, speculative="ngram", **config)
    assert _tokens(outs) == want
    s = engine.stats()
    assert 0 < s.accepted_tokens < s.draft_tokens  # some drafts held, some were rejected
    assert s.generation_tokens == sum(len(t) for t in want)
    assert engine.blocks.num_free == engine.blocks.num_blocks  # every block came back


def test_tiny_pool_preempts_and_speculation_still_matches(model, prompts, want):
    per_token = model.spec.kv_bytes_per_token(8)
    for caching in (True, False):
        engine, outs = _run(model, prompts, speculative="ngram", kv_cache_bytes=160 * per_token,
                            enable_prefix_caching=caching)  # fmt: skip
        assert _tokens(outs) == want
        assert engine.stats().num_preemptions > 0 and engine.stats().accepted_tokens > 0
        assert engine.blocks.num_free == engine.blocks.num_blocks


def test_after_every_step_tables_and_cache_hold_confirmed_tokens_only(model, prompts):
    """Without speculation a running sequence's table covers exactly its computed tokens
    after a step; rejected drafts must leave it so, and no cached block may name them."""
    engine = engine_for(model, block_size=4, speculative="ngram", num_speculative_tokens=7)
    for p in prompts:
        engine.add_request(p, GREEDY)
    final: list[list[int]] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final.append(out.prompt_token_ids + out.outputs[0].token_ids)
        for seq in engine.scheduler.running:
            assert len(seq.block_table) == engine.blocks.blocks_for(seq.num_computed_tokens)
            assert seq.num_computed_tokens == seq.num_tokens - 1 or seq.num_output_tokens == 0
    assert engine.stats().draft_tokens > engine.stats().accepted_tokens > 0
    valid = set()  # the names of every full block of the final sequences
    for tokens in final:
        h = None
        for i in range(len(tokens) // 4):
            h = block_hash(h, tuple(tokens[4 * i : 4 * i + 4]))
            valid.add(h)
    assert engine.blocks._cached and set(engine.blocks._cached) <= valid


def test_stops_and_max_tokens_cut_an_accepted_run_as_without_speculation(
    model, prompts, tiny_model_dir
):
    tokenizer = load_tokenizer(tiny_model_dir)
    looping = prompts[5:8]
    plain = _tokens(_run(model, looping)[1])
    # Stop tokens and strings taken from the middle of the outputs: they end the sequence
    # inside a run of accepted drafts.
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (3, 7, 11)]
    params += [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, stop_token_ids=[t[12]]) for t in plain
    ]
    params += [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, stop=[tokenizer.decode(t[14:16])])
        for t in plain
    ]
    batch = looping * 3
    plain_run = _summary(_run(model, batch, params, tokenizer)[1])
    engine, outs = _run(model, batch, params, tokenizer, speculative="ngram")
    assert _summary(outs) == plain_run
    assert engine.stats().accepted_tokens > 0
    assert [len(t) for t, *_ in plain_run[:3]] == [3, 7, 11]
    assert {reason for _, _, reason, _ in plain_run[3:]} == {"stop"}


def _summary(outs):
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outs
            for c in o.outputs]  # fmt: skip


def test_logprobs_of_accepted_tokens_equal_those_without_speculation(model, prompts, want):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    plain = _run(model, prompts, params)[1]
    engine, spec = _run(model, prompts, params, speculative="ngram")
    assert engine.stats().accepted_tokens > 0
    for a, b in zip(plain, spec, strict=True):
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert len(la) == len(lb) == NEW_TOKENS
        for x, y in zip(la, lb, strict=True):
            assert (x.token_id, x.rank, list(x.top)) == (y.token_id, y.rank, list(y.top))
            assert abs(x.logprob - y.logprob) < 1e-5
            assert all(abs(x.top[t] - y.top[t]) < 1e-5 for t in x.top)


def test_sampled_requests_do_not_speculate(model, prompts):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    plain = _tokens(_run(model, prompts, params)[1])
    engine, outs = _run(model, prompts, params, speculative="ngram")
    assert _tokens(outs) == plain
    assert engine.stats().draft_tokens == 0
