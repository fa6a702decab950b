"""Requests and tokens per minute, per tenant and per API key: token buckets in the gateway.

Each limit is a bucket that holds at most one minute's worth and refills continuously at
limit/60 per second, so a client may burst up to its minute's worth and then goes at the
rate. A request passes when every bucket it draws from (its tenant's and its key's,
requests and tokens) holds what it costs; then all of them are charged, else none is.

Tokens are not known before the answer: a request is charged an estimate up front (its
prompt's characters / 4, plus its max_tokens) and, once a whole answer reports its
`usage`, the difference is given back or taken (a bucket may go into debt: the next
requests wait for it). A stream is charged its estimate.

The buckets live in this control-plane process: with several control planes behind one
address, each enforces the limits on the requests it relays.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

CHARS_PER_TOKEN = 4  # the usual rough figure for English text with BPE tokenizers
# Completion tokens assumed when a request sets no max_tokens: OpenAI's default for
# completions; chat has no default, so a typical answer's length.
DEFAULT_MAX_TOKENS = {"/v1/completions": 16, "/v1/chat/completions": 256}


@dataclass(frozen=True, slots=True)
class Limit:
    """Per-minute limits of a tenant or a key; None: unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    @classmethod
    def of(cls, stored: dict | None) -> Limit:
        return cls(**stored) if stored else cls()


class Limited(Exception):
    """A request over a limit: what it hit (`kind`: "requests" or "tokens", as OpenAI's
    429s say), and how many seconds until it would pass."""

    def __init__(self, message: str, kind: str, retry_after: float) -> None:
        super().__init__(message)
        self.kind, self.retry_after = kind, retry_after


class Bucket:
    def __init__(self, per_minute: int, now: float) -> None:
        self.per_minute = per_minute
        self.level = float(per_minute)  # starts full
        self.at = now

    def refill(self, per_minute: int, now: float) -> None:
        """Top up for the time since the last refill, at the (possibly new) rate."""
        self.per_minute = per_minute
        rate = per_minute / 60.0
        self.level = min(float(per_minute), self.level + (now - self.at) * rate)
        self.at = now

    def wait(self, cost: float) -> float:
        """Seconds until `cost` (at most a full bucket) would pass; 0 if it passes now."""
        need = min(cost, float(self.per_minute))
        return max(0.0, (need - self.level) * 60.0 / self.per_minute)


class RateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._buckets: dict[tuple[str, int, str], Bucket] = {}

    def admit(self, owners: list[tuple[str, int, Limit]], tokens: int) -> None:
        """Charge one request and `tokens` to every owner's buckets (`owners`: (what, id,
        limit), e.g. ("tenant acme", 3, Limit(...))). Raises Limited, charging nothing,
        when any bucket is short."""
        now = self.clock()
        charges = []
        for owner, owner_id, limit in owners:
            for kind, per_minute, cost in (
                ("requests", limit.requests_per_minute, 1),
                ("tokens", limit.tokens_per_minute, tokens),
            ):
                if per_minute is None:
                    continue
                bucket = self._bucket((owner, owner_id, kind), per_minute, now)
                wait = bucket.wait(cost)
                if wait > 0:
                    message = (
                        f"rate limit of {owner}: {per_minute} {kind} per minute "
                        f"(this request needs {cost:g}); retry in {math.ceil(wait)} s"
                    )
                    raise Limited(message, kind, wait)
                charges.append((bucket, cost))
        for bucket, cost in charges:
            bucket.level -= cost

    def settle(self, owners: list[tuple[str, int, Limit]], charged: int, used: int) -> None:
        """A request charged `charged` tokens used `used`: give back or take the rest."""
        for owner, owner_id, limit in owners:
            bucket = self._buckets.get((owner, owner_id, "tokens"))
            if bucket is not None and limit.tokens_per_minute is not None:
                bucket.level = min(float(bucket.per_minute), bucket.level + charged - used)

    def _bucket(self, slot: tuple[str, int, str], per_minute: int, now: float) -> Bucket:
        bucket = self._buckets.get(slot)
        if bucket is None:
            bucket = self._buckets[slot] = Bucket(per_minute, now)
        else:
            bucket.refill(per_minute, now)
        return bucket


def estimate_tokens(path: str, body: dict) -> int:
    """The tokens a request is charged before its answer: its prompt's characters over
    CHARS_PER_TOKEN, plus the completion tokens it allows."""
    prompt = body.get("prompt", body.get("messages", ""))
    chars = len(prompt) if isinstance(prompt, str) else len(str(prompt))
    most = body.get("max_completion_tokens", body.get("max_tokens"))
    if not isinstance(most, int) or most < 0:
        most = DEFAULT_MAX_TOKENS.get(path, 16)
    n = body.get("n", 1)
    return math.ceil(chars / CHARS_PER_TOKEN) + most * (n if isinstance(n, int) and n > 0 else 1)
