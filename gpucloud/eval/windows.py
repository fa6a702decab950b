"""Rolling windows: score a text longer than the model's context, as lm-evaluation-harness's
rolling loglikelihood does.

Token 0 is the bos, which nothing precedes; every later token is scored exactly once. The
first window is the text's first `max_length` tokens; each next one ends `stride` tokens
further and reaches back `max_length` tokens, scoring only the tokens the windows before it
did not. A token so has up to max_length - 1 tokens of left context, and at least
max_length - stride. The default stride, max_length - 1, is lm-eval's (`context_len=1`):
the fewest windows. A text that fits is one window: the text scored whole.
"""

from __future__ import annotations

from typing import NamedTuple


class Window(NamedTuple):
    start: int  # the window's tokens are [start, end)
    end: int
    first: int  # it scores the tokens [first, end)


def rolling_windows(n_tokens: int, max_length: int, stride: int | None = None) -> list[Window]:
    """The windows over a text of `n_tokens` tokens (bos included) for a model that sees
    `max_length` tokens at once."""
    stride = max_length - 1 if stride is None else stride
    if max_length < 2 or not 1 <= stride < max_length:
        raise ValueError(f"need 1 <= stride ({stride}) < max_length ({max_length})")
    end = min(n_tokens, max_length)
    windows = [Window(0, end, 1)]
    while end < n_tokens:
        end = min(end + stride, n_tokens)
        windows.append(Window(end - max_length, end, windows[-1].end))
    return windows
