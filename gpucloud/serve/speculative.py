"""Speculative decoding: guess a few tokens cheaply, check them all in one forward pass.

A proposer guesses the next `k` tokens of a decoding sequence. The scheduler runs the
sequence's last token plus the guesses as one chunk (the multi-token path over paged KV
that chunked prefill uses), so the target model's logits at every guessed position come
from one forward. `accept` keeps the longest run of guesses that greedy decoding would
have produced, plus the target's own token after it: output is token for token what plain
greedy decoding gives, in fewer steps when the guesses are good.

How many tokens a sequence guesses, if any, follows how often its guesses held and what
a guess costs (`spec_policy`): speculation that does not pay turns itself off.

Only greedy sequences without logit processing (penalties, `min_tokens` still banning
stops) speculate; the others decode one token per step as before, so their distribution
is untouched. A structured-output grammar's masks are no obstacle: each verification row
is masked by the grammar's state after the guesses before it (`structured.mask_guessed_rows`).
"""

from __future__ import annotations

import numpy as np
import torch

from gpucloud.serve.sequence import Sequence


def ngram_proposal(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Prompt lookup: find the most recent earlier place where the sequence's last n tokens
    (n as large as possible, from `n_max` down to `n_min`) occurred, and propose the `k`
    tokens that followed it. A continuation that runs into the current end copies itself
    (a loop of period p keeps repeating), so a match always yields `k` tokens. Returns []
    when no n-gram of at least `n_min` tokens recurs."""
    last = len(tokens) - 1
    # The common miss costs one C-speed scan: the last token never occurred before.
    if last < n_min or k < 1 or tokens.index(tokens[last]) == last:
        return []
    seq = np.asarray(tokens)
    ends = np.flatnonzero(seq[:last] == seq[last])  # earlier positions holding the last token
    if ends.size == 0:
        return []
    matched = np.ones(ends.size, dtype=np.int64)
    for d in range(1, n_max):
        back = ends - d
        ok = (matched == d) & (back >= 0)
        ok[ok] = seq[back[ok]] == seq[last - d]
        if not ok.any():
            break
        matched += ok
    best = int(matched.max())
    if best < n_min:
        return []
    start = int(ends[np.flatnonzero(matched == best)[-1]]) + 1
    out: list[int] = []
    for i in range(start, start + k):
        out.append(tokens[i] if i <= last else out[i - last - 1])
    return out


def can_speculate(seq: Sequence) -> bool:
    """Greedy, unprocessed logits (a grammar's mask aside), and decoding (only its last
    token lacks KV)."""
    p = seq.params
    return (
        p.greedy
        and not p.has_penalties
        and seq.num_output_tokens >= p.min_tokens
        and seq.num_computed_tokens == seq.num_tokens - 1
    )


def accept(logits: torch.Tensor, draft: list[int]) -> list[int]:
    """The tokens greedy decoding emits, given the target's logits [len(draft) + 1, vocab]
    at the last known position and at each guessed one: the guesses up to the first that
    differs from the argmax, then the argmax at that position (a token of the target's own
    even when every guess holds)."""
    target = logits.argmax(-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return target[: n + 1]
