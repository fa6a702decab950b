"""Incremental detokenization and stop strings.

Byte-level BPE tokens can end in the middle of a UTF-8 character; decoding such a prefix
yields U+FFFD. Text is released only once the decoded tail is whole, and decoding restarts
a few tokens back (`prefix_offset`) so that spaces and merges read as in a full decode.
While stop strings are possible, the last `longest stop - 1` characters are held back: a
client never receives part of a stop string that later turns out to be one.
"""

from __future__ import annotations

from collections.abc import Callable

Decode = Callable[[list[int]], str]

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded ahead of the output for correct leading spaces


class IncrementalDetokenizer:
    def __init__(self, decode: Decode, prompt_ids: list[int], stop: list[str], include_stop: bool):
        self._decode = decode
        self._tokens = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._stop = stop
        self._include_stop = include_stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # output text so far (ends before a stop string once one matched)
        self._sent = 0  # characters of `text` already released

    def add(self, token_id: int) -> str | None:
        """Append one token. Returns the matched stop string, if the text now contains one."""
        self._tokens.append(token_id)
        prefix = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return None  # an incomplete character (or nothing visible) so far
        new = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        self.text += new
        return self._check_stop(len(new))

    def flush(self) -> None:
        """At the end, release undecodable trailing bytes as U+FFFD rather than drop them."""
        if self._read_offset < len(self._tokens):
            prefix = self._decode(self._tokens[self._prefix_offset : self._read_offset])
            self.text += self._decode(self._tokens[self._prefix_offset :])[len(prefix) :]
            self._read_offset = len(self._tokens)

    def delta(self, finished: bool) -> str:
        """Text not yet released; while running, minus the possible start of a stop string."""
        end = len(self.text) if finished else max(len(self.text) - self._holdback, self._sent)
        out = self.text[self._sent : end]
        self._sent = end
        return out

    def _check_stop(self, new_chars: int) -> str | None:
        if not self._stop:
            return None
        window = new_chars + self._holdback
        begin = max(len(self.text) - window, 0)
        for stop in self._stop:
            at = self.text.find(stop, begin)
            if at >= 0:
                self.text = self.text[: at + len(stop) if self._include_stop else at]
                return stop
        return None
