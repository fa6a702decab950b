"""Sampling features on fabricated logits: every filter keeps exactly the tokens it should."""

from __future__ import annotations

import math

import pytest
import torch

from gpucloud.errors import UserError
from gpucloud.serve.params import SamplingParams
from gpucloud.serve.sampler import Sampler
from gpucloud.serve.sequence import Sequence

EOS = 0


def seq(params: SamplingParams, prompt=(5, 6), outputs=(), index=0) -> Sequence:
    s = Sequence("r", index, params, list(prompt), len(prompt))
    if params.has_penalties:
        s.output_counts = {}
    for t in outputs:
        s.append(t)
    return s


def draw(params: SamplingParams, logits: list[float], times: int = 200, **kw) -> list[int]:
    sampler, row = Sampler({EOS}), torch.tensor([logits])
    return [sampler(row, [seq(params, **kw)])[0] for _ in range(times)]


LOGITS = [0.0, 3.0, 2.9, 2.0, 1.0, -1.0, -2.0, 0.5]  # token 1 is the most likely


def test_greedy_takes_the_argmax_row_by_row():
    sampler = Sampler({EOS})
    logits = torch.tensor([LOGITS, LOGITS[::-1]])
    g = SamplingParams(temperature=0)
    assert sampler(logits, [seq(g), seq(g)]) == [1, 6]


def test_top_k_top_p_and_min_p_keep_only_their_tokens():
    assert set(draw(SamplingParams(top_k=2), LOGITS)) == {1, 2}
    # top_p: token 1 alone holds < 0.4 of the mass, 1 and 2 together hold more.
    assert set(draw(SamplingParams(top_p=0.4), LOGITS)) == {1, 2}
    # min_p 0.5: exp(2.0 - 3.0) = 0.37 of the top probability is cut, 0.9 is kept.
    assert set(draw(SamplingParams(min_p=0.5), LOGITS)) == {1, 2}
    assert len(set(draw(SamplingParams(temperature=5.0), LOGITS, times=400))) == len(LOGITS)


def test_a_seed_reproduces_the_same_tokens_whatever_else_is_in_the_batch():
    sampler, params = Sampler({EOS}), SamplingParams(seed=42)
    noise = torch.randn(3, 50)
    alone = [sampler(noise[:1], [s])[0] for s in [seq(params)] for _ in range(20)]
    s1, other = seq(params), seq(SamplingParams())
    batched = [sampler(noise[:2], [s1, other])[0] for _ in range(20)]
    assert alone == batched
    assert len(set(alone)) > 1  # it does sample, it is not greedy


def test_repetition_presence_and_frequency_penalties_push_seen_tokens_down():
    logits = [0.0, 2.0, 1.9, 0.0]
    assert set(draw(SamplingParams(temperature=0), logits, times=1)) == {1}
    rep = SamplingParams(temperature=0, repetition_penalty=1.2)
    assert draw(rep, logits, times=1, prompt=(1,)) == [2]  # 2.0 / 1.2 < 1.9
    presence = SamplingParams(temperature=0, presence_penalty=0.2)
    assert draw(presence, logits, times=1, outputs=(1,)) == [2]
    assert draw(presence, logits, times=1, prompt=(1,)) == [1]  # the prompt does not count
    freq = SamplingParams(temperature=0, frequency_penalty=0.06)
    assert draw(freq, logits, times=1, outputs=(1,)) == [1]  # 2.0 - 0.06 > 1.9
    assert draw(freq, logits, times=1, outputs=(1, 1)) == [2]  # 2.0 - 0.12 < 1.9


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = [9.0, 1.0, 0.0, 5.0]
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    assert draw(params, logits, times=1, outputs=(2,)) == [1]
    assert draw(params, logits, times=1, outputs=(2, 2)) == [EOS]


def test_logprobs_report_the_raw_distribution_rank_and_top_n():
    params = SamplingParams(top_k=1, logprobs=3)
    s = seq(params)
    token = Sampler({EOS})(torch.tensor([LOGITS]), [s])[0]
    want = torch.tensor(LOGITS).log_softmax(-1)
    (lp,) = s.logprobs
    assert token == lp.token_id == 1 and lp.rank == 1
    assert math.isclose(lp.logprob, want[1].item(), rel_tol=1e-6)
    assert list(lp.top) == [1, 2, 3]
    assert math.isclose(lp.top[3], want[3].item(), rel_tol=1e-6)


def test_bad_params_name_the_field_and_the_allowed_values():
    with pytest.raises(UserError, match="top_p must be in \\(0, 1\\]"):
        SamplingParams(top_p=0)
    with pytest.raises(UserError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(UserError, match="n > 1 needs temperature > 0"):
        SamplingParams(n=2, temperature=0)
    with pytest.raises(UserError, match="logprobs must be in \\[0, 20\\]"):
        SamplingParams(logprobs=50)
    # values that reached torch and stopped the engine loop (a generator seed, tensors)
    with pytest.raises(UserError, match="seed must be in \\[0, 9223372036854775807\\]"):
        SamplingParams(seed=2**64)
    with pytest.raises(UserError, match="top_k must be in \\[1, 2147483647\\]"):
        SamplingParams(top_k=2**70)
    with pytest.raises(UserError, match="stop_token_ids must be token ids in"):
        SamplingParams(stop_token_ids=[-5])


def test_values_beyond_the_vocabulary_sample_as_if_absent():
    # a stop id no row has, banned until min_tokens: only EOS is banned (it raised IndexError)
    banned = SamplingParams(stop_token_ids=[3, 10**6], min_tokens=1, temperature=5.0)
    assert set(draw(banned, LOGITS, times=400)) == set(range(len(LOGITS))) - {EOS, 3}
    # top_k larger than the vocabulary keeps everything
    assert len(set(draw(SamplingParams(top_k=2**31 - 1, temperature=5.0), LOGITS, 400))) == 8
    # more top logprobs than the vocabulary has: all of it (topk raised before)
    s = seq(SamplingParams(logprobs=20))
    Sampler({EOS})(torch.tensor([LOGITS]), [s])
    assert len(s.logprobs[0].top) == len(LOGITS)
