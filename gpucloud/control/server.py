"""Starting a control plane: store, bootstrap, its executor's nodes, reconciler, uvicorn."""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import func, select

from gpucloud.control import db, tenancy, workloads
from gpucloud.control.app import create_app
from gpucloud.control.config import Settings
from gpucloud.control.executors.base import Executor
from gpucloud.control.lifecycle import REPLICA_HOLDS_GPUS, JobState
from gpucloud.control.models import Job, Replica
from gpucloud.control.reconciler import Reconciler
from gpucloud.control.services import nodes, tenants
from gpucloud.http_protocol import with_read_deadline


def _private_sqlite_file(db_url: str) -> None:
    """SQLite's file holds every tenant's env secrets: readable by the control plane only."""
    if db_url.startswith("sqlite:///"):
        path = Path(db_url.removeprefix("sqlite:///"))
        if path.exists():
            path.chmod(0o600)


def prepare(settings: Settings, executor: Executor) -> tuple[db.Store, str | None]:
    """Open (and migrate) the store, bootstrap it, register the executor's nodes (so the
    API knows them before the reconciler's first pass).

    Returns the store and the bootstrap admin key (None if the store already had one).
    """
    tenancy.check_mode(settings)
    for private in (settings.home, settings.logs_dir):  # the tenants' workloads never see it
        private.mkdir(mode=0o700, parents=True, exist_ok=True)
        private.chmod(0o700)
    inventory = executor.inventory()
    store = db.open_store(settings.db_url)
    _private_sqlite_file(settings.db_url)
    with store.transaction() as s:
        key = tenants.bootstrap(s)
        nodes.sync(s, inventory, time.time(), settings.node_timeout)
    return store, key


def serve(settings: Settings, store: db.Store, executor: Executor) -> None:
    """Run the API and the reconciler until interrupted."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # httpx logs every request it sends at INFO: one line per request the gateway forwards
    # and per probe of a replica, a formatted write in the gateway's event loop each time.
    # The gateway's own counters (gpucloud_gateway_requests_total) tell the same.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if executor.name == "local" and executor.inventory()[0].backend == "cpu":
        workloads.build_kernels(settings)
    app = create_app(store, settings, Reconciler(store, settings, executor))
    tune_gc()
    with _stop_signals_return():
        uvicorn.run(
            app,
            http=with_read_deadline(settings.request_read_timeout),
            host=settings.host,
            port=settings.port,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )


def tune_gc() -> None:
    """Set the garbage collector for a long-lived control plane, once its app is built.

    Everything made so far (modules, the app, its routes and schemas: ~10^5 objects) lives
    as long as the process. Frozen, the collector's full passes no longer walk it: at a
    queue of thousands, the reconciler's passes leave enough objects behind to set one off
    every second or so, and each held the GIL for ~0.2 s (~20 ms frozen), the API's worst
    latencies (benchmarks/control_plane.py). Then full passes ten times rarer than by
    default (each walks what the reconciler keeps between passes: at 10,000 pending jobs,
    ~70,000 objects), and a young generation of 2,000 objects rather than 700. In-process
    at 10,000 pending, a pass (read and decide) took 98-142 ms by default and 90 ms like
    this, its longest collection 13-23 ms and 4 ms. A young generation of 20,000 made
    passes no faster, and in the gateway, whose young objects are mostly garbage (requests,
    streams), each of its collections freed ~20,000 at once (12-29 ms under a flood).
    """
    gc.freeze()
    gc.set_threshold(2_000, 10, 100)


@contextlib.contextmanager
def _stop_signals_return() -> Iterator[None]:
    """Make SIGINT and SIGTERM end `serve` by returning, after uvicorn's graceful shutdown.

    Once shut down, uvicorn raises again the signal that stopped it, for the handler that
    was there before: SIGTERM's default would kill the process before the caller can say
    what became of the workloads. A handler that does nothing takes it instead.
    """
    stops = (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.signal(sig, lambda *_: None) for sig in stops}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def running_workloads(store: db.Store) -> int:
    """How many jobs and replicas have a process (running, or left running by a control
    plane that stopped)."""
    with store.reading() as s:
        jobs = s.scalar(
            select(func.count()).where(Job.state == JobState.RUNNING, Job.handle.is_not(None))
        )
        replicas = s.scalar(
            select(func.count()).where(
                Replica.state.in_(REPLICA_HOLDS_GPUS), Replica.handle.is_not(None)
            )
        )
    return jobs + replicas
