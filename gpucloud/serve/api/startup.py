"""When this server's process started, its weights finished loading and it became ready.

A replica's cold start is these phases, plus placing it before and the first token after.
`/ready` reports them and `/metrics` exports them as Unix timestamps (as Prometheus'
`process_start_time_seconds`), so a slow start can be split without reading logs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psutil


def _process_started() -> float:
    """This process's creation time as the OS records it: before the interpreter, the
    imports and the weights, which are part of a cold start too."""
    return psutil.Process().create_time()


@dataclass(slots=True)
class Startup:
    weights_loaded: float  # wall clock (time.time()), as the other two
    process_started: float = field(default_factory=_process_started)
    ready: float | None = None  # once the server answers requests

    def phases(self) -> dict[str, float | None]:
        return {
            "process_started": self.process_started,
            "weights_loaded": self.weights_loaded,
            "ready": self.ready,
        }

    def mark_ready(self) -> None:
        self.ready = time.time()
