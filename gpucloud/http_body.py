"""Request bodies both HTTP servers accept: at most a configured size, and strict JSON.

Python's json module reads NaN, Infinity and 1e400 (as inf), keeps lone UTF-16 surrogates
("\\ud800") in strings, and recurses once per nesting level until RecursionError. Each of
those used to reach a route and come back as a 500: a response that cannot encode the value,
a database that cannot store it, a stack that overflows. `BodyGuard`, an ASGI middleware,
checks every request before routing: a body larger than the limit is refused with 413 by its
Content-Length before it is read, or as soon as a chunked body grows past it; a body that is
not strict JSON is refused with 400. Routes then parse a body already known to be sound.

Both servers (the control plane, `gpucloud serve`) take only JSON bodies, so every
non-empty body is checked, whatever its Content-Type says.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The key of the checked body's JSON value in the request's state (`request.state`).
PARSED = "json_body"
MAX_DEPTH = 64  # nested arrays and objects; our deepest request schema uses 5
_NESTED = (str, dict, list)  # what the walk looks into (numbers were checked while parsing)
_SURROGATE = re.compile("[\ud800-\udfff]")  # json joins valid pairs: any left is lone


class BadBody(ValueError):
    """A request body refused before routing: `status` 400 or 413, and an error `code`."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def _too_large(limit: int) -> BadBody:
    return BadBody(413, "body_too_large", f"request body too large: the limit is {limit} bytes")


def loads(raw: bytes, allow_nul: bool = True) -> Any:
    """The JSON value of `raw`, strictly: UTF-8, finite numbers, no lone surrogates, at most
    MAX_DEPTH levels and, unless `allow_nul`, no NUL character in any string. Raises BadBody
    (400) saying what was wrong and where."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _invalid(f"the body is not UTF-8 text (byte {e.start})") from None
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except json.JSONDecodeError as e:
        raise BadBody(400, "invalid_json", f"malformed JSON body: {e}") from None
    except RecursionError:
        raise _too_deep() from None
    except BadBody:
        raise
    except ValueError:  # the one other way json fails: int() refuses that many digits
        raise _invalid(f"an integer has more than {sys.get_int_max_str_digits()} digits") from None
    _check_tree(value, allow_nul)
    return value


class BodyGuard:
    """ASGI middleware: reads each request's body (up to `limit(path)` bytes), checks it
    with `loads` (NUL characters refused where `allow_nul(path)` is false), and hands the app
    the same body, its JSON value in the request's state under PARSED; a refused body gets
    `refuse(path, error)` and never reaches a route. Paths where `streamed(path)` is true
    take bodies that are not JSON (an upload): their route reads them and owns the limit."""

    def __init__(
        self,
        app: ASGIApp,
        limit: Callable[[str], int],
        refuse: Callable[[str, BadBody], Response],
        allow_nul: Callable[[str], bool] = lambda _path: True,
        streamed: Callable[[str], bool] = lambda _path: False,
    ) -> None:
        self.app = app
        self.streamed = streamed
        self.limit = limit
        self.refuse = refuse
        self.allow_nul = allow_nul

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.streamed(scope["path"]):
            await self.app(scope, receive, send)
            return
        try:
            body = await _read(scope, receive, self.limit(scope["path"]))
            if body:  # kept for the app, which need not parse it again
                scope.setdefault("state", {})[PARSED] = loads(body, self.allow_nul(scope["path"]))
        except BadBody as error:
            await self.refuse(scope["path"], error)(scope, receive, send)
            return
        except _ClientLeft:
            return
        await self.app(scope, _replay(body, receive), send)


class _ClientLeft(Exception):
    pass


async def _read(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole body, or BadBody(413) once it is known to exceed `limit`: at once from its
    Content-Length, else as soon as the chunks read add up to more."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise _too_large(limit)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise _ClientLeft
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the body read already, then the server's messages (a
    disconnect, for apps that watch for one)."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _no_constant(name: str) -> float:
    raise _invalid(f"{name} is not a JSON number; numbers must be finite")


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _invalid(f"the number {literal[:40]} is out of range; numbers must be finite")
    return value


def _check_tree(value: Any, allow_nul: bool) -> None:
    """Depth, lone surrogates and NULs, without recursion: a walk over the containers that
    keeps each value's place (`env.A`, `command.1`) for the error."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        item, depth, where = stack.pop()
        if isinstance(item, str):
            _check_text(item, where, allow_nul)
        elif isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                raise _too_deep()
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in pairs:
                place = f"{where}.{key}" if where else str(key)
                if isinstance(key, str):
                    _check_text(key, f"{where or 'the body'} (a key)", allow_nul)
                if isinstance(child, _NESTED):
                    stack.append((child, depth + 1, place))


def _check_text(text: str, where: str, allow_nul: bool) -> None:
    at = f" at {where}" if where else ""
    found = _SURROGATE.search(text)
    if found is not None:
        raise _invalid(
            f"the string{at} holds a lone UTF-16 surrogate (\\u{ord(found.group()):04x}); "
            "strings must be valid Unicode"
        )
    if not allow_nul and "\x00" in text:
        raise _invalid(f"the string{at} holds a NUL character (\\u0000); this API refuses it")


def _too_deep() -> BadBody:
    return _invalid(f"arrays and objects are nested deeper than {MAX_DEPTH} levels")


def _invalid(reason: str) -> BadBody:
    return BadBody(400, "invalid_json", f"invalid JSON body: {reason}")
