"""uvicorn's HTTP protocols with a deadline for reading each request.

uvicorn times out only idle keep-alive connections between requests. A client that opens a
connection and sends its headers or its body a few bytes at a time keeps the connection,
its buffers and (once the headers are in) a request task for as long as it likes, so a few
hundred such clients exhaust a server (slowloris). With these protocols every request must
arrive whole, head and body, within `timeout` seconds of its first byte (of the connection,
for the first request); otherwise the server answers 408 and closes the connection.
Responses, such as a long token stream, are not limited.

Both HTTP servers use it: `uvicorn.Config(app, http=with_read_deadline(30.0))`. It is
httptools' protocol when httptools is installed (a C parser: a third less server CPU per
request than h11's pure-Python one, benchmarks/control_plane.py), else h11's.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_RECEIVED = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR)
Impl = Literal["auto", "httptools", "h11"]


def with_read_deadline(timeout: float, impl: Impl = "auto") -> type[asyncio.Protocol]:
    """The protocol class whose requests must be read within `timeout` seconds."""
    if timeout <= 0:
        raise ValueError(f"request read timeout must be > 0 seconds, got {timeout}")
    if impl == "auto":
        try:
            import httptools  # noqa: F401
        except ImportError:
            impl = "h11"
        else:
            impl = "httptools"
    base = _httptools_protocol() if impl == "httptools" else _DeadlineH11Protocol
    return type(f"Deadline{impl.capitalize()}Protocol", (base,), {"read_timeout": timeout})


class _Deadline:
    """The timer both protocols share: armed when a request's first byte may come, disarmed
    once it is whole; on expiry a 408 (if no response started) and a closed connection."""

    read_timeout = 30.0
    _timer: asyncio.TimerHandle | None = None
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def _arm(self) -> None:
        self._timer = self.loop.call_later(self.read_timeout, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _request_whole(self) -> bool:
        raise NotImplementedError

    def _response_started(self) -> bool:
        cycle = getattr(self, "cycle", None)
        return cycle is not None and cycle.response_started

    def _expired(self) -> None:
        self._timer = None
        if self.transport.is_closing() or self._request_whole():
            return
        if not self._response_started():
            detail = f"the request did not arrive whole within {self.read_timeout:g} s"
            body = json.dumps({"detail": detail}).encode()
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )
        self.transport.close()  # an app still reading the body gets http.disconnect


class _DeadlineH11Protocol(_Deadline, H11Protocol):
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

    def _request_whole(self) -> bool:
        return self.conn.their_state in _RECEIVED


def _httptools_protocol() -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class _DeadlineHttpToolsProtocol(_Deadline, HttpToolsProtocol):
        """The parser calls on_message_begin at a request's first byte and
        on_message_complete once its body is in, pipelined requests included."""

        _reading = True  # from the connection's start until its first request is whole

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            self._reading = True
            if self._timer is None:
                self._arm()
            super().on_message_begin()

        def on_message_complete(self) -> None:
            self._reading = False
            self._disarm()
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _request_whole(self) -> bool:
            return not self._reading

    return _DeadlineHttpToolsProtocol
