"""The control plane that runs for a GPUCLOUD_HOME, found through HOME/control-plane.json.

`gpucloud up` and `gpucloud server` write the file when they start: pid, its start time,
URL, database, grace period and executor. It stays after they stop, so that `gpucloud down
--stop-workloads` knows which database holds the workloads left running. A file whose
process has ended (or whose pid was recycled: another start time) names no live control
plane. The file is private (0600): a PostgreSQL URL may hold a password.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from gpucloud.control.config import Settings
from gpucloud.errors import ConfigError

FILE = "control-plane.json"


@dataclass(frozen=True, slots=True)
class Instance:
    pid: int
    start_time: float
    url: str
    db_url: str
    grace_seconds: float
    executor: str = "local"  # where its workloads run (files written before: local)
    ray_address: str | None = None

    def alive(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            started = proc.create_time()
            return proc.status() != psutil.STATUS_ZOMBIE and abs(started - self.start_time) < 1
        except psutil.Error:
            return False


def path(home: Path) -> Path:
    return Path(home) / FILE


def read(home: Path) -> Instance | None:
    """What the file of `home` says, live or not; None without a readable file."""
    try:
        return Instance(**json.loads(path(home).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def running(home: Path) -> Instance | None:
    """The control plane that serves for `home` now, or None."""
    inst = read(home)
    return inst if inst is not None and inst.alive() else None


def claim(settings: Settings) -> Instance:
    """Record this process as the control plane of `settings.home`.

    Raises ConfigError when another live one already serves for it: two reconcilers on the
    same workloads would each stop what the other starts.
    """
    other = running(settings.home)
    if other is not None and other.pid != os.getpid():
        raise ConfigError(
            f"a control plane already runs for {settings.home} (pid {other.pid}, {other.url}): "
            "stop it with `gpucloud down`, or set GPUCLOUD_HOME to another directory"
        )
    me = Instance(
        os.getpid(),
        psutil.Process().create_time(),
        settings.url,
        settings.db_url,
        settings.grace_seconds,
        settings.executor,
        settings.ray_address,
    )
    p = path(settings.home)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(me), f)
    tmp.replace(p)
    return me


def stop(inst: Instance, timeout: float = 60.0) -> None:
    """SIGTERM the control plane (it shuts down gracefully; its workloads keep running) and
    wait until it is gone; SIGKILL it if it is still there after `timeout` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(inst.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while inst.alive():
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(inst.pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.05)
