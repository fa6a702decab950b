"""Fault injection for tests of what runs around a server, off unless asked for.

With GPUCLOUD_SERVE_FAULTS=1 in its environment, SIGUSR1 kills the server's engine loop as a
device error would: the loop raises on its next turn, `/health` then answers 503 "engine
failed" and requests 503 `engine_dead`, while the process and its HTTP side live on. The
control plane's tests use it to check that such a replica is found and replaced: no
request a client can send kills the engine loop on purpose. Without the variable nothing
is installed and SIGUSR1 keeps its default action.
"""

from __future__ import annotations

import os
import signal
import threading

from gpucloud.serve.engine import LLMEngine

ENV = "GPUCLOUD_SERVE_FAULTS"


class InjectedFault(RuntimeError):
    """The engine loop's death, asked for with SIGUSR1."""


def install(engine: LLMEngine) -> bool:
    """Arm SIGUSR1 to kill `engine`'s loop if the environment asks for it (from the main
    thread, where signal handlers are set). Returns whether it did."""
    if os.environ.get(ENV) != "1":
        return False
    killed = threading.Event()
    step, has_unfinished = engine.step, engine.has_unfinished

    def failing_step():
        if killed.is_set():
            raise InjectedFault(f"engine loop killed by SIGUSR1 ({ENV}=1)")
        return step()

    engine.step = failing_step  # type: ignore[method-assign]
    # an idle loop takes a turn at once, instead of at the next request
    engine.has_unfinished = lambda: killed.is_set() or has_unfinished()  # type: ignore[method-assign]
    signal.signal(signal.SIGUSR1, lambda *_: killed.set())
    return True
