"""Prompt logprobs from the engine equal transformers' log-softmax, whatever the engine does
with the prompt: chunked prefill, prefix-cache hits it must not take, preemption in the
middle of a prompt, siblings of an `n > 1` request."""

from __future__ import annotations

import pytest
import torch
from serve_helpers import engine_for, hf_twin, random_model, run_engine

from gpucloud.serve import SamplingParams

LENGTHS = [1, 2, 9, 40, 75]
TOLERANCE = 1e-9  # float64 on both sides: only summation order differs


@pytest.fixture(scope="module")
def tiny():
    model = random_model("tiny", torch.float64)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, model.spec.vocab_size, (n,), generator=gen).tolist()
               for n in LENGTHS]  # fmt: skip
    hf = hf_twin(model)
    with torch.inference_mode():
        want = [hf(torch.tensor([p])).logits[0].log_softmax(-1) for p in prompts]
    return model, prompts, want


def assert_scores(outs, prompts, want, top_n: int) -> None:
    for out, ids, lp in zip(outs, prompts, want, strict=True):
        entries = out.prompt_logprobs
        assert len(entries) == len(ids) and entries[0] is None
        for i in range(1, len(ids)):
            e, row = entries[i], lp[i - 1]
            assert e.token_id == ids[i]
            assert abs(e.logprob - float(row[ids[i]])) < TOLERANCE
            assert e.rank == int((row > row[ids[i]]).sum()) + 1
            assert list(e.top) == row.topk(top_n).indices.tolist()


def scoring(top_n: int = 2, **fields) -> SamplingParams:
    return SamplingParams(prompt_logprobs=top_n, temperature=0, **{"max_tokens": 0, **fields})


def test_chunked_prefill_scores_every_prompt_token(tiny):
    model, prompts, want = tiny
    engine = engine_for(model, block_size=4, max_num_batched_tokens=16)
    outs = run_engine(engine, prompts, scoring())
    assert_scores(outs, prompts, want, 2)
    assert all(o.outputs[0].token_ids == [] and o.outputs[0].finish_reason == "length"
               for o in outs)  # fmt: skip
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_cached_prompts_are_recomputed_for_their_scores(tiny):
    model, prompts, want = tiny
    engine = engine_for(model, block_size=4)
    run_engine(engine, prompts, SamplingParams(max_tokens=1))  # fills the prefix cache
    outs = run_engine(engine, prompts, scoring(top_n=0, max_tokens=3, logprobs=1))
    assert_scores(outs, prompts, want, 0)
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert all(len(o.outputs[0].logprobs) == 3 for o in outs)
    # A plain request right after still takes the cache's blocks.
    assert run_engine(engine, prompts[-1:], SamplingParams(max_tokens=1))[0].num_cached_tokens


def test_preemption_in_the_middle_of_a_prompt_keeps_each_score_once(tiny):
    model, prompts, want = tiny
    prompts, want = prompts[::-1], want[::-1]
    per_token = model.spec.kv_bytes_per_token(8)
    # 88 tokens of KV: the 40-token prompt starts beside the 75-token one, which then needs
    # its blocks to decode: it is preempted with 5 prompt tokens computed, and recomputed.
    engine = engine_for(model, block_size=4, max_num_batched_tokens=16,
                        kv_cache_bytes=88 * per_token)  # fmt: skip
    outs = run_engine(engine, prompts, scoring(max_tokens=4, ignore_eos=True))
    assert engine.stats().num_preemptions == 1
    assert_scores(outs, prompts, want, 2)


def test_siblings_share_the_prompt_scores(tiny):
    model, prompts, want = tiny
    engine = engine_for(model, block_size=4, max_num_batched_tokens=16)
    params = SamplingParams(prompt_logprobs=1, n=3, temperature=1.0, seed=0, max_tokens=2)
    outs = run_engine(engine, prompts[2:], params)
    assert_scores(outs, prompts[2:], want[2:], 1)
    assert all(len(o.outputs) == 3 for o in outs)
