"""Settings of one control-plane process, and where it keeps its files.

Everything lives under GPUCLOUD_HOME (default ~/.gpucloud): the SQLite store, the workloads'
logs and the CLI's credentials file.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpucloud.control.executors.base import WorkloadRef


def home() -> Path:
    return Path(os.environ.get("GPUCLOUD_HOME") or Path.home() / ".gpucloud")


@dataclass(slots=True)
class Settings:
    home: Path = field(default_factory=home)
    db_url: str = ""  # empty = SQLite at HOME/state.db
    host: str = "127.0.0.1"
    port: int = 8470
    node_name: str = field(default_factory=socket.gethostname)
    virtual_gpus: int | None = None  # declare N CPU slots instead of detecting accelerators
    gpu_type: str = "L4"  # the catalog type virtual slots stand for (prices their usage)
    # CPU cores and memory this node offers to workloads that request them; None = all of
    # the machine's (the cores this process may run on, the physical memory).
    node_cpus: float | None = None
    node_memory_gib: float | None = None
    # Seconds between passes when nothing wakes the loop and work is in flight; with none,
    # the loop waits up to max(this, reconciler.IDLE_INTERVAL) for an API call to wake it.
    reconcile_interval: float = 1.0
    grace_seconds: float = 10.0  # SIGTERM -> SIGKILL
    retry_backoff: float = 2.0  # first retry delay; doubles per attempt
    max_backoff: float = 300.0
    ready_timeout: float = 600.0  # a replica not ready by then is restarted
    # A replica of a version that ended (promoted over, rolled back) is stopped once the
    # gateway has no request in flight on it, or this many seconds after, whatever is open.
    drain_limit: float = 60.0
    # Seconds a control plane's claim on a batch it runs lasts unless renewed (it renews it
    # every third of that): another control plane on the same database takes over a batch
    # whose owner stopped renewing (batch_runner.py).
    batch_lease: float = 30.0
    # A READY replica's /health is probed this often (the answer must come within as long);
    # after this many failures in a row it is replaced (at once if its engine died).
    probe_interval: float = 5.0
    probe_failures: int = 3
    policy: str = "priority"  # a scheduler preset; quotas are always enforced
    min_run: float = 60.0  # seconds a job runs before a higher priority may preempt it
    request_read_timeout: float = 30.0  # a request's head and body must arrive by then
    # Largest request bodies (413 beyond, before they are read whole): the REST API's, and
    # the /v1 gateway's (prompts are larger; replicas accept 8 MiB by default too).
    max_body_bytes: int = 1 << 20
    gateway_max_body_bytes: int = 8 << 20
    max_upload_bytes: int = 256 << 20  # an uploaded workdir or model dir, unpacked
    workload_pids: int = 4096  # processes and threads of one workload (its cgroup's limit)
    # Tenants' workloads run as uids first + tenant id (see tenancy); single-tenant mode runs
    # them all as one user (the only mode without root). Exports: dirs every tenant's
    # workloads may use besides their own area (datasets, shared scratch).
    tenant_uids: tuple[int, int] = (62000, 62999)
    single_tenant: bool = False
    exports: tuple[Path, ...] = ()
    # Compiled CPU kernels, built by this process's user and shown read-only to replicas
    # (gpucloud.serve.cpu_kernels): a tenant's build is never loaded by another tenant.
    kernel_dir: Path = field(default_factory=lambda: Path.home() / ".cache/gpucloud/kernels")
    # Where workloads run (gpucloud.control.executors): this machine, a Ray cluster (at
    # ray_address) or a Slurm cluster (its client commands' own configuration).
    executor: str = "local"
    ray_address: str | None = None
    # A node whose executor stops reporting it is DOWN after this many seconds; its
    # workloads are failed over (jobs requeued, replicas replaced elsewhere).
    node_timeout: float = 30.0
    # Where this node's device telemetry comes from (gpucloud.hal.telemetry.SPECS): exported
    # on /metrics; a fatal device error makes the node DOWN with the reason.
    telemetry: str = "auto"
    # The cap (GiB) of the object-storage cache of the workloads' nodes (storage_cache); None:
    # its default.
    storage_cache_max_gb: float | None = None
    # Seconds deployments and interactive jobs may sit idle before they are reclaimed
    # (control/idle.py) unless their tenant or they set another; None: never.
    idle_ttl: float | None = None

    def __post_init__(self) -> None:
        self.home = Path(self.home)
        self.exports = tuple(Path(os.path.abspath(p)) for p in self.exports)
        if not self.db_url:
            self.db_url = f"sqlite:///{self.home / 'state.db'}"

    def backoff(self, failures: int) -> float:
        """Seconds a workload (a job's attempts, a replica's restarts) waits after its
        `failures`-th failure: retry_backoff, doubled per failure, at most max_backoff."""
        return min(self.retry_backoff * 2 ** min(max(failures - 1, 0), 64), self.max_backoff)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    def log_path(self, ref: WorkloadRef) -> Path:
        return self.logs_dir / f"{ref}.log"
