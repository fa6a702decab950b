"""Rolling windows: score a text longer than the model's context, as lm-evaluation-harness's
rolling loglikelihood does.

Token 0 is the bos, which nothing precedes; every later token is scored exactly once. The
first window is the text's first `max_length` tokens; each next one ends `stride` tokens
further and reaches back `max_length` tokens, scoring only the tokens the windows before it
did not. A token so has up to max_length - 1 tokens of left context, and at least
max_length - stride. The default stride, max_length - 1, is lm-eval's (`context_len=1`):
the fewest windows. A text that fits is one window: the text scored whole.

A window is one token shorter than the model's context (`window_length`): through an
endpoint a window is a completions prompt that must leave room for one generated token
(vLLM refuses `max_tokens` 0), and in this process windows are cut the same way, so a text
scores the same in-process and through `gpucloud serve`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from gpucloud.errors import UserError

Logprobs = list[float | None]


class Window(NamedTuple):
    start: int  # the window's tokens are [start, end)
    end: int
    first: int  # it scores the tokens [first, end)


def window_length(max_model_len: int) -> int:
    """The longest window a model with this context scores: a prompt plus one token."""
    return max_model_len - 1


def resolve_stride(max_length: int, stride: int | None) -> int:
    """`stride`, or lm-eval's default for windows of `max_length` tokens. Raises UserError
    when it is out of range."""
    if max_length < 2:
        raise UserError(f"a window of {max_length} token cannot score a token given another")
    if stride is None:
        return max_length - 1
    if not 1 <= stride < max_length:
        raise UserError(
            f"--stride {stride} is out of range: from 1 to {max_length - 1} (the model's "
            f"windows are {max_length} tokens)"
        )
    return stride


def rolling_windows(n_tokens: int, max_length: int, stride: int | None = None) -> list[Window]:
    """The windows over a text of `n_tokens` tokens (bos included) for windows of
    `max_length` tokens."""
    stride = resolve_stride(max_length, stride)
    end = min(n_tokens, max_length)
    windows = [Window(0, end, 1)]
    while end < n_tokens:
        end = min(end + stride, n_tokens)
        windows.append(Window(end - max_length, end, windows[-1].end))
    return windows


def score_in_windows(
    texts_ids: Sequence[list[int]],
    max_length: int,
    stride: int | None,
    score: Callable[[list[list[int]]], list[Logprobs]],
) -> list[Logprobs]:
    """Per text (its token ids, bos first), each token's logprob, None for the bos: every
    window of every text scored in one call of `score` (token-id prompts -> per-token
    logprobs, None first), each window's new tokens kept."""
    plans = [rolling_windows(len(ids), max_length, stride) for ids in texts_ids]
    windows = [ids[w.start : w.end] for ids, plan in zip(texts_ids, plans, strict=True)
               for w in plan]  # fmt: skip
    scored = iter(score(windows))
    out = []
    for plan in plans:
        logprobs: Logprobs = [None]  # the bos: nothing precedes it
        for w in plan:
            logprobs += next(scored)[w.first - w.start :]
        out.append(logprobs)
    return out
