"""Priority classes of API keys: `interactive` requests go to a replica at once; `batch`
ones only while few of them are in flight, so a flood of batch work does not fill the
replicas' batches and slow every interactive request down.

A replica's engine batches every request it has: each one in its batch makes every step
longer, and a request that arrives behind a full queue waits for it. So the gateway lets
at most `batch_in_flight` batch requests per ready replica of a deployment in at once; the
others wait here, first come first served, and each one in flight that finishes lets the
next in. Interactive requests never wait for batch ones.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Literal

PriorityClass = Literal["interactive", "batch"]
INTERACTIVE: PriorityClass = "interactive"
BATCH: PriorityClass = "batch"


class QueueTimeout(Exception):
    """A batch request waited its whole bound for a slot."""


class BatchGate:
    """The batch requests of one deployment in flight through this gateway."""

    def __init__(self) -> None:
        self.in_flight = 0
        self._limit = 1
        self._waiting: deque[asyncio.Future[None]] = deque()

    async def enter(self, limit: int, timeout: float) -> None:
        """Take a slot among `limit` (at least 1), waiting up to `timeout` seconds behind
        the requests that came first. Raises QueueTimeout."""
        self._limit = max(1, limit)
        self._let_in()
        if self.in_flight < self._limit and not self._waiting:
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

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _let_in(self) -> None:
        while self._waiting and self.in_flight < self._limit:
            turn = self._waiting.popleft()
            self.in_flight += 1
            turn.set_result(None)
