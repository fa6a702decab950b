"""How each replica answered the gateway lately: errors and time to first token.

The gateway adds one sample per request a replica took (`observe`); the automatic
rollback (control/rollback.py) compares a canary's replicas with the stable ones over a
window. The samples of the replicas of deployments with a guarded canary are also stored
(`save`, each reconciler pass, older ones dropped), and a control plane that restarts takes
them back (`load`), so its window does not start empty: samples from before a restart and
after it decide together.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass

from sqlalchemy import delete, insert, select
from sqlalchemy.orm import Session

from gpucloud.control.db import Store
from gpucloud.control.models import ReplicaSample

KEEP = 10_000  # samples kept per replica: a window's worth at 160 requests/s for a minute
UNSAVED = 100_000  # new samples kept for `save` (more are dropped: no pass runs to take them)


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
        # replica id -> (wall clock time, error?, seconds to the first token or None)
        self._samples: dict[int, deque[tuple[float, bool, float | None]]] = defaultdict(
            lambda: deque(maxlen=KEEP)
        )
        self._unsaved: deque[tuple[int, float, bool, float | None]] = deque(maxlen=UNSAVED)
        self._loaded: set[int] = set()  # replicas whose stored samples were taken back

    def observe(self, replica_id: int, now: float, status: int, ttft: float | None) -> None:
        """One request the replica answered with `status` (599: the connection failed) at
        `now` (wall clock), its first token `ttft` seconds after it was sent."""
        error = status >= 500
        sample = (now, error, None if error else ttft)
        self._samples[replica_id].append(sample)
        self._unsaved.append((replica_id, *sample))

    def window(self, replica_ids: list[int], since: float) -> Window:
        """The samples of `replica_ids` taken at `since` (wall clock) or later."""
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

    def load(self, session: Session, replica_ids: set[int], since: float) -> None:
        """Take back the stored samples (taken at `since` or later) of the replicas among
        `replica_ids` whose samples this process has not taken back yet."""
        new = replica_ids - self._loaded
        if not new:
            return
        rows = session.execute(
            select(ReplicaSample.replica_id, ReplicaSample.at, ReplicaSample.error,
                   ReplicaSample.ttft)
            .where(ReplicaSample.replica_id.in_(new), ReplicaSample.at >= since)
        )  # fmt: skip
        for rid, at, error, ttft in rows:
            self._samples[rid].appendleft((at, error, ttft))
        self._loaded |= new

    def save(self, store: Store, replica_ids: set[int], since: float) -> None:
        """Store the new samples of `replica_ids` and drop the stored ones taken before
        `since` or of other replicas; other replicas' new samples are not stored."""
        taken = [self._unsaved.popleft() for _ in range(len(self._unsaved))]
        rows = [
            {"replica_id": rid, "at": at, "error": error, "ttft": ttft}
            for rid, at, error, ttft in taken
            if rid in replica_ids
        ]
        if not rows:
            return  # no write: the rows left are dropped with the next ones
        with store.transaction() as s:
            s.execute(insert(ReplicaSample), rows)
            s.execute(
                delete(ReplicaSample).where(
                    ReplicaSample.replica_id.not_in(replica_ids) | (ReplicaSample.at < since)
                )
            )

    def forget(self, keep: set[int]) -> None:
        """Drop the samples of replicas not in `keep` (stopped ones)."""
        for rid in set(self._samples) - keep:
            del self._samples[rid]
