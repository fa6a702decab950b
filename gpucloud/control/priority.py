"""Priority classes of API keys: `interactive` requests go to a replica at once; `batch`
ones only while few of them are in flight, so a flood of batch work does not fill the
replicas' batches and slow every interactive request down.

A replica's engine batches every request it has: each one in its batch makes every step
longer, and a request that arrives behind a full queue waits for it. So the gateway lets
at most `batch_in_flight` batch requests per ready replica of a deployment in at once; the
others wait here, first come first served, and each one in flight that finishes lets the
next in. Interactive requests never wait for batch ones; and while one of them waits for its
first token, no batch request is let in (`hold`) unless none is in flight: a batch request
arriving at the replica then would take its turn in the replica's HTTP loop and engine
right when the interactive one needs them. The hold lasts until the first token only, and
one batch request always may run, so interactive traffic, however dense, slows batch work
down but does not stop it.

The replica is told each request's class too, as the `priority` field of its body (vLLM's:
lower runs first): its engine pauses batch requests while an interactive one waits for its
first token, so the batch ones let in do not lengthen that wait either.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Callable
from typing import Literal

PriorityClass = Literal["interactive", "batch"]
INTERACTIVE: PriorityClass = "interactive"
BATCH: PriorityClass = "batch"


# The engine priority (`priority` in a /v1 body) of each class; a caller's own is replaced.
ENGINE_PRIORITY: dict[str, int] = {INTERACTIVE: 0, BATCH: 1}


def with_priority(raw: bytes, body: object, priority_class: str) -> bytes:
    """The request body `raw` (parsed: `body`) with its class's engine priority."""
    wanted = ENGINE_PRIORITY[priority_class]
    if not isinstance(body, dict) or body.get("priority", 0) == wanted:
        return raw
    return json.dumps({**body, "priority": wanted}).encode()


class QueueTimeout(Exception):
    """A batch request waited its whole bound for a slot."""


class BatchGate:
    """The batch requests of one deployment in flight through this gateway."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.held = 0  # interactive requests waiting for their first token
        self._limit = 1
        self._waiting: deque[asyncio.Future[None]] = deque()

    def hold(self) -> Callable[[], None]:
        """Let no batch request in until the returned call (idempotent) lifts this hold."""
        self.held += 1
        lifted = False

        def lift() -> None:
            nonlocal lifted
            if not lifted:
                lifted = True
                self.held -= 1
                self._let_in()

        return lift

    async def enter(self, limit: int, timeout: float) -> None:
        """Take a slot among `limit` (at least 1), waiting up to `timeout` seconds behind
        the requests that came first. Raises QueueTimeout."""
        self._limit = max(1, limit)
        self._let_in()
        if self.in_flight < self._limit and not self._waiting and self._open():
            self.in_flight += 1
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await asyncio.wait_for(asyncio.shield(turn), timeout)
        except BaseException as e:  # the bound, or the client went away
            if turn.done():
                self.leave()  # the slot came just as it stopped waiting: hand it on
            else:
                turn.cancel()
                self._waiting.remove(turn)
            if isinstance(e, TimeoutError):
                raise QueueTimeout from None
            raise

    def leave(self) -> None:
        """Give a slot back: the first waiting request takes it."""
        self.in_flight -= 1
        self._let_in()

    def _open(self) -> bool:
        """Whether a batch request may go in now (a free slot aside): no hold, or none in
        flight (holds that overlap all the time do not stop batch work)."""
        return not self.held or not self.in_flight

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _let_in(self) -> None:
        while self._waiting and self.in_flight < self._limit and self._open():
            turn = self._waiting.popleft()
            self.in_flight += 1
            turn.set_result(None)
