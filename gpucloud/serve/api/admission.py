"""Checks that run before a request body is read: API key and draining.

A pure ASGI middleware, so a refused request costs no reading and no parsing. The body's
size and JSON are checked next, by `gpucloud.http_body.BodyGuard` (see `app.py`).
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from gpucloud.serve.api.errors import error_response
from gpucloud.serve.api.state import ServerState


class Admission:
    def __init__(self, app: ASGIApp, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _guarded(scope["path"]):
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope):
        state, settings = self.state, self.state.settings
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if settings.api_key is not None:
            message = _key_problem(headers.get("authorization"), settings.api_key)
            if message is not None:
                state.metrics.reject("unauthorized")
                return error_response(401, message, "invalid_api_key")
        if scope["method"] == "POST" and state.draining:
            state.metrics.reject("draining")
            return error_response(503, "the server is shutting down; retry on another replica",
                                  "server_draining")  # fmt: skip
        return None


def _key_problem(authorization: str | None, key: str) -> str | None:
    if not authorization:
        return "missing API key: send the header 'Authorization: Bearer <key>'"
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        return "incorrect API key"
    return None


def _guarded(path: str) -> bool:
    """The API's paths: /v1's and the tokenizer's (health, readiness and metrics are open)."""
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")
