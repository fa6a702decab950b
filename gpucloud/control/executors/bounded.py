"""Calls into an engine's client library that may wait on a server with no deadline.

Ray's driver API waits on its head (the GCS) without a timeout of its own: a head that
stops answering (stopped, swapping, a network partition that leaves its TCP connections
open) would hold `ray.nodes()`, and with it the reconciler's pass, forever. Each call made
through `Bounded` runs on a daemon thread of its own (one that never holds up the
process's exit) and is given at most `timeout` seconds; past that the caller gets
`Unresponsive` and goes on. The late call waits on until the server answers again;
meanwhile further calls fail at once rather than pile up behind it, so one silent server
costs a pass one timeout, not one per call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class Unresponsive(Exception):
    """The server did not answer a call in time (the message says which and since when)."""


class Bounded:
    """Runs calls to `what` (e.g. "the Ray head at 10.0.0.1:6379"), each for at most
    `timeout` seconds."""

    def __init__(self, what: str, timeout: float) -> None:
        self.what, self.timeout = what, timeout
        self._lock = threading.Lock()
        self._late: Future | None = None  # a call past its timeout, still waiting
        self._late_since = 0.0

    def __call__(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs)'s result or exception. Raises Unresponsive when it took
        longer than the timeout, or while an earlier call still waits."""
        if not self._lock.acquire(timeout=self.timeout):
            raise Unresponsive(f"{self.what} is busy with another call")
        try:
            if self._late is not None and not self._late.done():
                silent = time.monotonic() - self._late_since
                raise Unresponsive(f"{self.what} has not answered for {silent:.0f} s")
            self._late = None
            future: Future = Future()
            threading.Thread(
                target=_run, args=(future, fn, args, kwargs), name="bounded-call", daemon=True
            ).start()
            try:
                return future.result(self.timeout)
            except TimeoutError:
                if future.done():  # the call's own TimeoutError
                    raise
                self._late, self._late_since = future, time.monotonic() - self.timeout
                raise Unresponsive(
                    f"{self.what} did not answer within {self.timeout:g} s"
                ) from None
        finally:
            self._lock.release()


def _run(future: Future, fn: Callable, args: tuple, kwargs: dict) -> None:
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as e:  # handed to the caller, who re-raises it
        future.set_exception(e)
