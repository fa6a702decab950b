"""Reading HTTP/1.1 answers off a raw socket, for tests that speak the protocol by hand.

One `recv` returns whatever TCP delivered so far: a server may send the head and the body
of one answer in separate segments. These helpers read until the answer is whole.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit


def read_response(conn: socket.socket) -> bytes:
    """One whole answer (head and Content-Length body); raises if the peer closes early."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += _more(conn, data)
    head, _, body = data.partition(b"\r\n\r\n")
    length = _content_length(head)
    while len(body) < length:
        body += _more(conn, head + body)
    return head + b"\r\n\r\n" + body


def read_until_closed(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := conn.recv(65536):
        out += chunk
    return out


def _more(conn: socket.socket, so_far: bytes) -> bytes:
    chunk = conn.recv(65536)
    if not chunk:
        raise ConnectionError(f"connection closed mid-answer after {so_far!r}")
    return chunk


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    raise ValueError(f"answer without Content-Length: {head!r}")


def send_and_read(url: str, *parts: bytes) -> bytes:
    """Send `parts` (a request head, maybe some of its body) on a new connection to the
    server at `url` and read one whole answer. The rest of the body is never sent: a server
    that waited for all of it would answer only at its read deadline (408)."""
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=30) as conn:
        for part in parts:
            conn.sendall(part)
        return read_response(conn)
