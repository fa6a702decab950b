"""The FastAPI application: routers under /api/v1, the OpenAI gateway under /v1, errors
mapped to HTTP once, /metrics.

`create_app` takes a store and settings; when it gets a reconciler, the app runs the
reconciler's loop in a background thread for as long as it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.exc import DataError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpucloud.control import console
from gpucloud.control.auth import KeyCache
from gpucloud.control.autoscaler import Autoscaler
from gpucloud.control.batch_runner import BatchRunner
from gpucloud.control.config import Settings
from gpucloud.control.db import GroupCommit, Store
from gpucloud.control.errors import AuthError, ConflictError, ForbiddenError
from gpucloud.control.gateway import Gateway, GatewayError
from gpucloud.control.gateway import router as gateway_routes
from gpucloud.control.idle import IdleReclaimer
from gpucloud.control.metrics import Metrics
from gpucloud.control.rollback import AutoRollback
from gpucloud.control.routes import (
    batch_api,
    budgets,
    deployments,
    jobs,
    keys,
    nodes,
    prices,
    registry,
    tenants,
    uploads,
    usage,
)
from gpucloud.control.services import jobs as job_service
from gpucloud.errors import CapacityError, GpucloudError, NotFoundError, TooLargeError, UserError
from gpucloud.http_body import BadBody, BodyGuard

API = "/api/v1"

# Most specific first: the first class an error is an instance of picks the status.
_STATUS: list[tuple[type[GpucloudError], int]] = [
    (AuthError, 401),
    (ForbiddenError, 403),
    (NotFoundError, 404),
    (ConflictError, 409),
    (CapacityError, 409),
    (TooLargeError, 413),
    (UserError, 400),
    (GpucloudError, 500),
]


def status_of(error: GpucloudError) -> int:
    return next(code for cls, code in _STATUS if isinstance(error, cls))


def create_app(store: Store, settings: Settings, reconciler=None) -> FastAPI:
    """The control plane's ASGI app. `reconciler` (a `Reconciler`) runs while the app serves."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if reconciler is not None:
            reconciler.start()
        try:
            async with gateway.open():
                batches = asyncio.create_task(batch_runner.run()) if reconciler else None
                try:
                    yield
                finally:
                    if batches is not None:
                        batches.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await batches
        finally:
            if reconciler is not None:
                reconciler.stop()

    app = FastAPIOffline(  # /docs and /redoc with their assets served from the package
        title="gpucloud control plane",
        version="1",
        description="Tenants, jobs, deployments, nodes and usage of a gpucloud cluster.",
        lifespan=lifespan,
    )
    metrics = Metrics(store)
    if reconciler is not None and reconciler.executor.telemetry is not None:
        metrics.watch_devices(settings.node_name, reconciler.executor.telemetry)
    gateway = Gateway(store, metrics)
    app.state.gateway = gateway
    batch_runner = BatchRunner(store, settings, gateway)  # runs with the reconciler
    app.state.batch_runner = batch_runner
    app.state.store = store
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.keys = KeyCache(store)
    app.state.job_submissions = GroupCommit(store, job_service.submit_many, unread=True)
    app.state.wake = reconciler.wake if reconciler is not None else (lambda: None)
    gateway.wake = app.state.wake  # a request waiting for a replica starts a pass
    if reconciler is not None:
        reconciler.metrics = metrics
        reconciler.autoscaler = Autoscaler(gateway)
        reconciler.reclaimer = IdleReclaimer(settings, gateway, reconciler.executor.telemetry)
        reconciler.auto_rollback = AutoRollback(gateway.replica_stats)
        reconciler.drained = gateway.drained
    # Routes are matched in order: job submissions, the busiest, first.
    for module in (jobs, deployments, tenants, keys, nodes, uploads, usage, prices, budgets,
                   registry):  # fmt: skip
        app.include_router(module.router, prefix=API)
    app.include_router(gateway_routes)  # /v1, OpenAI's paths
    app.include_router(batch_api.router)  # /v1/files, /v1/batches
    console.mount(app)  # the web console: / and /console

    @app.exception_handler(GpucloudError)
    async def _domain_error(request: Request, error: GpucloudError) -> JSONResponse:
        code = status_of(error)
        if _openai(request.url.path):
            return _openai_error(code, str(error))
        headers = {"WWW-Authenticate": "Bearer"} if code == 401 else None
        body = {"detail": str(error), "error": type(error).__name__}
        return JSONResponse(body, status_code=code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, error: RequestValidationError) -> Response:
        if not _openai(request.url.path):
            return await request_validation_exception_handler(request, error)
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return _openai_error(400, f"{where}: {first['msg']}")

    @app.exception_handler(DataError)
    async def _bad_value(_request: Request, error: DataError) -> JSONResponse:
        # The database refused a value the schema let through (e.g. a NUL byte in text).
        detail = f"invalid value: {str(error.orig).splitlines()[0]}"
        return JSONResponse({"detail": detail, "error": "UserError"}, status_code=400)

    # NUL is no part of any name, command, path or env of the REST API (no process can be
    # started with one); prompts on /v1 may hold it.
    app.add_middleware(
        BodyGuard,
        limit=_body_limit(settings),
        refuse=_refuse_body,
        allow_nul=_openai,
        streamed=lambda path: (
            path in (f"{API}/uploads", "/v1/files") or path.startswith(console.PREFIX)
        ),
    )
    app.add_middleware(_Timed, metrics=metrics)

    @app.get("/metrics", include_in_schema=False)
    def _metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app


def _body_limit(settings: Settings):
    def limit(path: str) -> int:
        return settings.gateway_max_body_bytes if _openai(path) else settings.max_body_bytes

    return limit


def _refuse_body(path: str, error: BadBody) -> Response:
    """A body refused before routing, in the shape of the API it was sent to."""
    if _openai(path):
        kind = "invalid_request_error"
        return GatewayError(error.status, str(error), kind, error.code).response()
    return JSONResponse({"detail": str(error), "error": "UserError"}, status_code=error.status)


def _openai_error(status: int, message: str) -> JSONResponse:
    """An error of the /v1 API, in OpenAI's shape."""
    kind = {401: "authentication_error", 403: "permission_error"}.get(status)
    kind = kind or ("api_error" if status >= 500 else "invalid_request_error")
    return GatewayError(status, message, kind).response()


def _openai(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


class _Timed:
    """API latency per method, route and status, up to the response's headers (a stream's
    length is the client's business). Plain ASGI: Starlette's BaseHTTPMiddleware would pass
    every streamed chunk through an extra task and queue, halving the gateway's rate."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                path = getattr(scope.get("route"), "path", "unmatched")
                if scope["path"].startswith(API) and not path.startswith(API):
                    path = API + path  # included routers' routes carry no prefix
                self.metrics.api_latency.labels(
                    scope["method"], path, str(message["status"])
                ).observe(time.perf_counter() - start)
            await send(message)

        await self.app(scope, receive, timed_send)
