"""Run the app with uvicorn, draining on SIGTERM.

uvicorn alone stops listening on SIGTERM, so a load balancer's next request is refused at
the TCP level and the process dies by the re-raised signal. Here the first SIGTERM only
starts a drain: `/ready` and new requests answer 503 while in-flight requests finish (up to
`drain_timeout`, then they are aborted), and the process then exits 0. A second SIGTERM or
a Ctrl-C stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn
from fastapi import FastAPI

from gpucloud.http_protocol import with_read_deadline
from gpucloud.serve.api.state import ServerState

log = logging.getLogger(__name__)

_POLL = 0.05  # seconds between checks for in-flight requests while draining
_CLOSE_GRACE = 5.0  # seconds uvicorn waits for open connections once the drain is over


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float):
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # Not calling super(): it would record the signal and re-raise it after shutdown.
        if sig == signal.SIGTERM and not self.state.draining and self._loop is not None:
            self.state.draining = True
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))
        elif self.should_exit:
            self.force_exit = True
        else:
            self.should_exit = True

    async def _drain(self) -> None:
        bridge = self.state.bridge
        log.info("SIGTERM: draining %d open requests (at most %.0f s)", bridge.num_open,
                 self.drain_timeout)  # fmt: skip
        deadline = time.monotonic() + self.drain_timeout
        while bridge.num_open and time.monotonic() < deadline:
            await asyncio.sleep(_POLL)
        if bridge.num_open:
            log.warning("drain timeout: aborting %d requests", bridge.num_open)
            bridge.abort_all()
        self.should_exit = True


def run(
    app: FastAPI,
    host: str,
    port: int,
    drain_timeout: float,
    log_level: str = "info",
    access_log: bool = False,
    read_timeout: float = 30.0,
) -> None:
    """Serve until SIGTERM (drained) or Ctrl-C; returns normally in both cases. A request
    not read whole within `read_timeout` seconds is answered 408 (gpucloud.http_protocol)."""
    config = uvicorn.Config(
        app,
        http=with_read_deadline(read_timeout),
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=_CLOSE_GRACE,
        lifespan="on",
    )
    DrainingServer(config, app.state.server, drain_timeout).run()
