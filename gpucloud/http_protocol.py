"""uvicorn's h11 protocol with a deadline for reading each request.

uvicorn times out only idle keep-alive connections between requests. A client that opens a
connection and sends its headers or its body a few bytes at a time keeps the connection,
its buffers and (once the headers are in) a request task for as long as it likes, so a few
hundred such clients exhaust a server (slowloris). With this protocol every request must
arrive whole, head and body, within `timeout` seconds of its first byte (of the connection,
for the first request); otherwise the server answers 408 and closes the connection.
Responses, such as a long token stream, are not limited.

Both HTTP servers use it: `uvicorn.Config(app, http=with_read_deadline(30.0))`.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_RECEIVED = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR)


def with_read_deadline(timeout: float) -> type[H11Protocol]:
    """The h11 protocol class whose requests must be read within `timeout` seconds."""
    if timeout <= 0:
        raise ValueError(f"request read timeout must be > 0 seconds, got {timeout}")
    return type("DeadlineH11Protocol", (_DeadlineH11Protocol,), {"read_timeout": timeout})


class _DeadlineH11Protocol(H11Protocol):
    read_timeout = 30.0
    _timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._timer is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state in _RECEIVED:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._timer = self.loop.call_later(self.read_timeout, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.transport.is_closing() or self.conn.their_state in _RECEIVED:
            return
        if self.cycle is None or not self.cycle.response_started:
            detail = f"the request did not arrive whole within {self.read_timeout:g} s"
            body = json.dumps({"detail": detail}).encode()
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )
        self.transport.close()  # an app still reading the body gets http.disconnect
