"""The ASGI app: OpenAI routes, vLLM's tokenize routes, health, readiness and metrics over
one engine."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from gpucloud.http_body import BadBody, BodyGuard
from gpucloud.serve.api import errors, faults, routes, tokenize
from gpucloud.serve.api.admission import Admission
from gpucloud.serve.api.startup import Startup
from gpucloud.serve.api.state import APISettings, ServerState
from gpucloud.serve.engine import LLMEngine


def build_app(
    engine: LLMEngine, settings: APISettings, weights_loaded: float | None = None
) -> FastAPI:
    """An app serving `engine` (already loaded, at `weights_loaded`: default now). Its
    engine thread runs from the app's startup to its shutdown; `app.state.server` is the
    `ServerState`."""
    state = ServerState(engine, settings, Startup(weights_loaded or time.time()))
    faults.install(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.bridge.start()
        state.started = True
        state.startup.mark_ready()
        try:
            yield
        finally:
            state.started = False
            state.bridge.abort_all()
            state.bridge.stop()

    # /docs and /redoc with their assets served from the package: they work offline
    app = FastAPIOffline(title="gpucloud OpenAI-compatible server", lifespan=lifespan)
    app.state.server = state
    errors.install(app)
    app.include_router(routes.router)
    app.include_router(tokenize.router)

    def refuse(_path: str, error: BadBody):
        state.metrics.reject(error.code)
        return errors.error_response(error.status, str(error), error.code)

    limit = settings.max_body_bytes
    app.add_middleware(BodyGuard, limit=lambda _path: limit, refuse=refuse)
    app.add_middleware(Admission, state=state)  # added last, runs first: no body read yet
    return app
