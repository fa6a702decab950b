"""How each replica answered the gateway lately: errors and time to first token.

The gateway adds one sample per request a replica took (`observe`); the automatic
rollback (control/rollback.py) compares a canary's replicas with the stable ones over a
window. Samples live in this process only: after a restart the window fills again.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass

KEEP = 10_000  # samples kept per replica: a window's worth at 160 requests/s for a minute


@dataclass(frozen=True, slots=True)
class Window:
    """Several replicas' samples since some time."""

    requests: int
    errors: int
    ttfts: tuple[float, ...]  # seconds, of the answers that were not errors, sorted

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def p99_ttft(self) -> float | None:
        if not self.ttfts:
            return None
        return self.ttfts[min(len(self.ttfts) - 1, math.ceil(0.99 * len(self.ttfts)) - 1)]


class ReplicaStats:
    def __init__(self) -> None:
        # replica id -> (monotonic time, error?, seconds to the first token or None)
        self._samples: dict[int, deque[tuple[float, bool, float | None]]] = defaultdict(
            lambda: deque(maxlen=KEEP)
        )

    def observe(self, replica_id: int, now: float, status: int, ttft: float | None) -> None:
        """One request the replica answered with `status` (599: the connection failed),
        its first token `ttft` seconds after it was sent."""
        error = status >= 500
        self._samples[replica_id].append((now, error, None if error else ttft))

    def window(self, replica_ids: list[int], since: float) -> Window:
        """The samples of `replica_ids` taken at `since` (monotonic) or later."""
        requests = errors = 0
        ttfts = []
        for rid in replica_ids:
            for at, error, ttft in tuple(self._samples.get(rid, ())):
                if at < since:
                    continue
                requests += 1
                errors += error
                if ttft is not None:
                    ttfts.append(ttft)
        return Window(requests, errors, tuple(sorted(ttfts)))

    def forget(self, keep: set[int]) -> None:
        """Drop the samples of replicas not in `keep` (stopped ones)."""
        for rid in set(self._samples) - keep:
            del self._samples[rid]
