"""Starting a control plane: store, bootstrap, this machine as a node, reconciler, uvicorn."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
from sqlalchemy import func, select

from gpucloud import hardware
from gpucloud.control import db, tenancy, workloads
from gpucloud.control.app import create_app
from gpucloud.control.config import Settings
from gpucloud.control.lifecycle import REPLICA_HOLDS_GPUS, JobState
from gpucloud.control.models import Job, Replica
from gpucloud.control.reconciler import Reconciler
from gpucloud.control.services import nodes, tenants
from gpucloud.errors import ConfigError
from gpucloud.http_protocol import with_read_deadline


@dataclass(frozen=True, slots=True)
class LocalNode:
    gpu_type: str
    gpus: int
    backend: str
    labels: dict[str, str]


def host_resources(settings: Settings) -> tuple[int, int]:
    """The millicores and MiB this node offers: the settings', else what the machine has."""
    cpus = settings.node_cpus
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = settings.node_memory_gib
    if memory is None:
        memory = psutil.virtual_memory().total / 2**30
    if cpus <= 0 or memory <= 0:
        raise ConfigError(f"a node needs CPUs and memory > 0, got {cpus:g} and {memory:g} GiB")
    # whole MiB, rounded down: a node must not offer more than it has
    return int(cpus * 1000), int(memory * 1024)


def detect_node(settings: Settings) -> LocalNode:
    """This machine's accelerators, or `--virtual-gpus` CPU slots of `settings.gpu_type`.

    Detection runs `gpucloud hardware local` in a child process: the control plane itself
    never imports torch. Raises ConfigError when there is nothing to schedule on.
    """
    if settings.virtual_gpus is not None:
        if settings.virtual_gpus < 1:
            raise ConfigError(f"--virtual-gpus must be >= 1, got {settings.virtual_gpus}")
        gpu_type = hardware.get(settings.gpu_type).name
        return LocalNode(gpu_type, settings.virtual_gpus, "cpu", {"virtual": "true"})
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from gpucloud.cli.main import app; app()",
            "hardware",
            "local",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0:
        raise ConfigError(f"could not detect accelerators: {out.stderr.strip()[-500:]}")
    info = json.loads(out.stdout)
    if info["backend"] == "cpu":
        raise ConfigError(
            "no accelerators found on this machine: pass --virtual-gpus N to "
            "declare N CPU slots for trying the platform"
        )
    name = info["devices"][0]["name"]
    return LocalNode(
        catalog_type(name, settings.gpu_type),
        len(info["devices"]),
        info["backend"],
        {"device": name},
    )


def catalog_type(device_name: str, fallback: str) -> str:
    """The catalog type a device reports itself as (e.g. 'NVIDIA H100 80GB HBM3')."""
    norm = device_name.upper().replace(" ", "-")
    matches = [a.name for a in hardware.all_accelerators() if a.name.upper() in norm]
    if not matches:
        short = [
            a.name for a in hardware.all_accelerators() if a.name.split("-")[0].upper() in norm
        ]
        matches = short
    return max(matches, key=len) if matches else hardware.get(fallback).name


def _private_sqlite_file(db_url: str) -> None:
    """SQLite's file holds every tenant's env secrets: readable by the control plane only."""
    if db_url.startswith("sqlite:///"):
        path = Path(db_url.removeprefix("sqlite:///"))
        if path.exists():
            path.chmod(0o600)


def prepare(settings: Settings) -> tuple[db.Store, str | None]:
    """Open (and migrate) the store, bootstrap it, register this machine as a node.

    Returns the store and the bootstrap admin key (None if the store already had one).
    """
    tenancy.check_mode(settings)
    for private in (settings.home, settings.logs_dir):  # the tenants' workloads never see it
        private.mkdir(mode=0o700, parents=True, exist_ok=True)
        private.chmod(0o700)
    local = detect_node(settings)
    cpu_milli, memory_mib = host_resources(settings)
    store = db.open_store(settings.db_url)
    _private_sqlite_file(settings.db_url)
    with store.transaction() as s:
        key = tenants.bootstrap(s)
        nodes.register(
            s,
            settings.node_name,
            local.gpu_type,
            local.gpus,
            local.backend,
            local.labels,
            cpu_milli=cpu_milli,
            memory_mib=memory_mib,
        )
    return store, key


def serve(settings: Settings, store: db.Store) -> None:
    """Run the API and the reconciler until interrupted."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if detect_node(settings).backend == "cpu":
        workloads.build_kernels(settings)
    app = create_app(store, settings, Reconciler(store, settings))
    # Everything made so far (modules, the app, its routes and schemas: ~10^5 objects)
    # lives as long as the process. Frozen, the collector's full passes no longer walk it:
    # at a queue of thousands, the reconciler's passes leave enough objects behind to set
    # one off every second or so, and each held the GIL for ~0.2 s (~20 ms frozen), the
    # API's worst latencies (benchmarks/control_plane.py).
    gc.freeze()
    with _stop_signals_return():
        uvicorn.run(
            app,
            http=with_read_deadline(settings.request_read_timeout),
            host=settings.host,
            port=settings.port,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )


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
            select(func.count()).where(Job.state == JobState.RUNNING, Job.pid.is_not(None))
        )
        replicas = s.scalar(
            select(func.count()).where(
                Replica.state.in_(REPLICA_HOLDS_GPUS), Replica.pid.is_not(None)
            )
        )
    return jobs + replicas
