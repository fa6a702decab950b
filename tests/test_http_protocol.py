"""The request read deadline on a real uvicorn server, with each HTTP parser: slow heads and
bodies get 408 and a closed connection; slow responses and kept-alive connections are not
limited."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from http_wire import read_response, read_until_closed

from gpucloud.http_protocol import with_read_deadline

DEADLINE = 0.5


@pytest.fixture(scope="module", params=["httptools", "h11"])
def port(request) -> Iterator[int]:
    app = FastAPI()

    @app.get("/slow")
    async def slow() -> dict:
        await asyncio.sleep(2 * DEADLINE)  # answering may take longer than reading
        return {"ok": True}

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"got": len(await request.body())}

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=free,
        http=with_read_deadline(DEADLINE, request.param),
        log_level="error",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield free
    server.should_exit = True
    thread.join(timeout=10)


def _connect(port: int) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.settimeout(10 * DEADLINE)
    return conn


def test_a_head_that_never_ends_gets_408_and_a_closed_connection(port):
    with _connect(port) as conn:
        started = time.monotonic()
        conn.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n")  # no blank line: head unfinished
        reply = read_until_closed(conn)
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert b"did not arrive whole within 0.5 s" in reply
    assert DEADLINE <= time.monotonic() - started < 5 * DEADLINE


def test_a_body_that_stops_coming_gets_408(port):
    with _connect(port) as conn:
        conn.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\ncontent-length: 10\r\n\r\nabc")
        assert read_until_closed(conn).startswith(b"HTTP/1.1 408 ")


def test_an_idle_connection_is_closed_by_the_deadline(port):
    with _connect(port) as conn:
        assert read_until_closed(conn).startswith(b"HTTP/1.1 408 ")


def test_slow_answers_and_kept_alive_connections_are_not_limited(port):
    with _connect(port) as conn:
        conn.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        first = read_response(conn)  # sent after 2 x the deadline
        time.sleep(0.6 * DEADLINE)
        conn.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\ncontent-length: 3\r\n\r\nabc")
        second = read_response(conn)  # the connection has lived past the deadline: still served
    assert first.startswith(b"HTTP/1.1 200 ") and first.endswith(b'{"ok":true}')
    assert second.startswith(b"HTTP/1.1 200 ") and second.endswith(b'{"got":3}')


def test_the_deadline_must_be_positive():
    with pytest.raises(ValueError, match="must be > 0 seconds"):
        with_read_deadline(0)


def test_auto_picks_the_c_parser_when_installed():
    assert with_read_deadline(1.0).__name__ == "DeadlineHttptoolsProtocol"
