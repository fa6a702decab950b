"""Which version of a deployment serves a request: the stable one, or its canary.

A canary takes `percent` of the requests. A request that names a `user` (OpenAI's field)
goes where a hash of that user falls, so each user stays on one version for as long as the
split lasts; other requests are spread by a running credit (each adds `percent`, and the
one that reaches 100 goes to the canary), which keeps the share exact over any run of
100 / gcd(percent, 100) requests instead of only on average.

The chosen version's replicas are tried first, the other's after: a request whose version
has no ready replica yet, or whose replica refuses it while draining, is served by the
other instead of failing.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass

Replicas = list[tuple[int, str]]  # (replica id, base URL)
_BUCKETS = 10_000  # a user's hash falls in one of these; percent resolves to 0.01


@dataclass(frozen=True, slots=True)
class Canary:
    percent: float  # of the deployment's requests
    replicas: frozenset[int]  # ids of its ready replicas


def sticky_bucket(user: str) -> int:
    """Where `user` falls in 0.._BUCKETS-1, the same in every control-plane process."""
    digest = hashlib.blake2b(user.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % _BUCKETS


class Splitter:
    """The version choice, with a running credit per deployment."""

    def __init__(self) -> None:
        self._credit: dict[int, float] = defaultdict(float)

    def groups(
        self, deployment_id: int, replicas: Replicas, canary: Canary | None, user: object
    ) -> list[Replicas]:
        """`replicas` split in the groups to try in turn: the chosen version's, then the
        other's (either left out when empty)."""
        if canary is None:
            return [replicas]
        to_canary = self.picks_canary(deployment_id, canary.percent, user)
        chosen = [r for r in replicas if (r[0] in canary.replicas) == to_canary]
        other = [r for r in replicas if (r[0] in canary.replicas) != to_canary]
        return [g for g in (chosen, other) if g]

    def picks_canary(self, deployment_id: int, percent: float, user: object) -> bool:
        if isinstance(user, str) and user:
            return sticky_bucket(user) < percent * _BUCKETS / 100
        credit = self._credit[deployment_id] + percent
        to_canary = credit >= 100.0 - 1e-9
        self._credit[deployment_id] = credit - 100.0 if to_canary else credit
        return to_canary
