"""Speculative decoding: guess a few tokens cheaply, check them all in one forward pass.

A proposer guesses the next `k` tokens of a decoding sequence. The scheduler runs the
sequence's last token plus the guesses as one chunk (the multi-token path over paged KV
that chunked prefill uses), so the target model's logits at every guessed position come
from one forward. `accept` keeps the longest run of guesses that greedy decoding would
have produced, plus the target's own token after it: output is token for token what plain
greedy decoding gives, in fewer steps when the guesses are good.

A sequence whose guesses all fail stops guessing for a while, twice as long after each
such try in a row (1, 3, 7, ... up to `MAX_PAUSE` steps), and its next try guesses one
token; one accepted guess ends the pauses and restores the full guess. On text that no
proposer predicts, guessing would cost a draft model's forwards and the verification of
rejected rows on every step; backed off, it costs one one-token try in `MAX_PAUSE` steps.

Only greedy sequences without logit processing (penalties, `min_tokens` still banning
stops, a structured-output grammar) speculate; the others decode one token per step as
before, so their distribution is untouched.
"""

from __future__ import annotations

import numpy as np
import torch

from gpucloud.serve.sequence import Sequence

MAX_PAUSE = 63  # steps without guessing after six or more failed tries in a row


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
    """Greedy, unprocessed logits, and decoding (only its last token lacks KV)."""
    p = seq.params
    return (
        p.greedy
        and seq.grammar is None
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


def back_off(seq: Sequence, guessed: int, accepted: int) -> None:
    """After a verification: a try whose guesses all failed pauses guessing (longer after
    each such try in a row); an accepted guess resets the pause."""
    if guessed == 0:
        return
    if accepted:
        seq.draft_misses = seq.draft_len = 0
        return
    seq.draft_misses += 1
    seq.draft_pause = min(2**seq.draft_misses - 1, MAX_PAUSE)
    seq.draft_len = 1
