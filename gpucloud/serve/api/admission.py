"""Checks that run before a request body is read: API key, draining, body size.

A pure ASGI middleware, so a refused request costs no parsing and a body that is too large
is cut off as it streams in (a chunked upload has no Content-Length to check up front).
"""

from __future__ import annotations

import hmac

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from gpucloud.serve.api.errors import error_response
from gpucloud.serve.api.state import ServerState


class Admission:
    def __init__(self, app: ASGIApp, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        if scope["method"] == "POST":
            receive = _limited(receive, self.state.settings.max_body_bytes)
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope):
        state, settings = self.state, self.state.settings
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if settings.api_key is not None:
            message = _key_problem(headers.get("authorization"), settings.api_key)
            if message is not None:
                state.metrics.reject("unauthorized")
                return error_response(401, message, "invalid_api_key")
        if scope["method"] != "POST":
            return None
        if state.draining:
            state.metrics.reject("draining")
            return error_response(503, "the server is shutting down; retry on another replica",
                                  "server_draining")  # fmt: skip
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > settings.max_body_bytes:
            state.metrics.reject("body_too_large")
            return error_response(413, _too_large(settings.max_body_bytes), "body_too_large")
        return None


def _key_problem(authorization: str | None, key: str) -> str | None:
    if not authorization:
        return "missing API key: send the header 'Authorization: Bearer <key>'"
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        return "incorrect API key"
    return None


def _too_large(limit: int) -> str:
    return f"request body too large: the limit is {limit} bytes"


def _limited(receive: Receive, limit: int) -> Receive:
    seen = 0

    async def receive_limited():
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise HTTPException(413, _too_large(limit))
        return message

    return receive_limited
