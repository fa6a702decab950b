"""Where a /v1 request's time to its first token goes in the gateway, phase by phase.

  - `admit`: from the request's arrival to its sending: route, rate limits, a batch
    request's wait for a slot, a wait for a replica to start;
  - `upstream`: from then to the replica's response headers (connecting, sending, and any
    replica skipped on the way; a whole answer's headers come once it is done);
  - `first_chunk`: a stream's, from the headers to its first event (the replica's queue,
    prefill and first step);
  - `first_write`: from then to that event handed to the client's connection.

Each phase is observed in `gpucloud_gateway_phase_seconds` by tenant, deployment and
priority class, and the first two, known when the response starts, go to the client in
a `Server-Timing` header (durations in milliseconds, as browsers' developer tools and
benchmarks/gateway_priority.py read them), so a slow request can be told apart from a
slow replica.
"""

from __future__ import annotations

import time

from prometheus_client import Histogram

PHASES = ("admit", "upstream", "first_chunk", "first_write")


class Timing:
    """One request's phases, by the monotonic clock, each observed as it ends."""

    __slots__ = ("_histogram", "_labels", "_last", "_spent")

    def __init__(self, histogram: Histogram, tenant: str, deployment: str, priority_class: str,
                 arrived: float) -> None:  # fmt: skip
        self._histogram = histogram
        self._labels = (tenant, deployment, priority_class)
        self._last = arrived
        self._spent: dict[str, float] = {}

    def end(self, phase: str) -> None:
        """The phase `phase` ended now (it began where the one before ended); once each."""
        if phase in self._spent:
            return
        now = time.monotonic()
        self._spent[phase] = seconds = now - self._last
        self._last = now
        self._histogram.labels(*self._labels, phase).observe(seconds)

    def header(self) -> str:
        """The phases ended so far, as a Server-Timing header's value."""
        return ", ".join(f"{phase};dur={s * 1e3:.2f}" for phase, s in self._spent.items())
