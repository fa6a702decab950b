"""The local executor: each workload runs on this machine in a sandbox of its tenant
(gpucloud.control.sandbox): its own user, namespaces and cgroup.

The sandbox records the command's exit code in a file beside the log when it ends, so a
control plane restarted after a crash learns how an adopted workload ended even though it
is not that process's parent. A workload's cgroup is named after its reference (job-12,
replica-5) and its handle's token is "pid:start time": a restarted control plane finds it
again by these alone. Its one node is this machine, reported by every reconciler pass that
runs here: that is the node's heartbeat.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import psutil

from gpucloud.control.config import Settings
from gpucloud.control.executors.base import (
    Exit,
    Handle,
    Launch,
    NodeInfo,
    StartError,
    last_line,
)
from gpucloud.control.executors.local_node import local_node
from gpucloud.control.sandbox import SETUP_FAILED, Sandbox, SandboxError, scope_for
from gpucloud.hal.telemetry import Monitor, open_source


class LocalExecutor:
    name = "local"

    def __init__(self, settings: Settings) -> None:
        self.sandbox = Sandbox(scope_for(settings.home))
        self.settings = settings
        self.logs_dir = settings.logs_dir
        self._node: NodeInfo | None = None
        self._children: dict[int, subprocess.Popen] = {}
        self.telemetry = Monitor(open_source(settings.telemetry))

    @property
    def node(self) -> NodeInfo:
        """This machine, detected once (a child process that imports torch: seconds)."""
        if self._node is None:
            self._node = local_node(self.settings)
        return self._node

    def inventory(self) -> list[NodeInfo]:
        """This machine; unhealthy while its telemetry shows a fatal device error."""
        fatal = self.telemetry.fatal()
        return [replace(self.node, healthy=False, reason="; ".join(fatal)) if fatal else self.node]

    def start(self, launch: Launch) -> Handle:
        """Start the command in its sandbox, output appended to its log file (0600).
        Raises StartError if it cannot be started (a missing command starts, and exits
        127)."""
        if [p.node for p in launch.parts] != [self.node.name]:
            raise StartError(f"the local executor runs workloads on {self.node.name} only")
        try:
            launch.log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.close(os.open(launch.log_path, os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o600))
            env = {**launch.env, **launch.parts[0].env}
            exit_path = _exit_path(launch.log_path)
            proc = self.sandbox.start(
                launch.sandbox_spec(str(launch.ref), env, launch.log_path, exit_path)
            )
        except (OSError, ValueError, SandboxError) as e:  # ValueError: a NUL byte
            raise StartError(str(e)) from e
        self._children[proc.pid] = proc
        return Handle(launch.ref, f"{proc.pid}:{_start_time(proc.pid) or time.time()!r}")

    def poll(self, handle: Handle) -> Exit | None:
        """None while the workload runs; its Exit once it ended (its sandbox torn down)."""
        pid = _pid(handle)
        child = self._children.get(pid)
        if child is not None:
            code = child.poll()
            if code is None:
                return None
            del self._children[pid]
            return self._ended(handle, code)
        if self.sandbox.running(str(handle.ref), pid):
            return None
        return self._ended(handle, None)

    def stop(self, handle: Handle, grace: float) -> Exit:
        """SIGTERM every process of the workload, SIGKILL all after `grace` seconds; wait
        until nothing of it is left."""
        pid = _pid(handle)
        self.sandbox.stop(str(handle.ref), pid, grace)
        child = self._children.pop(pid, None)
        code = None
        while child is not None:
            try:
                code = child.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                # Stopped while its sandbox was being set up: the kill found no cgroup yet,
                # and what started after it would run on (a replica's `sleep 30` did).
                self.sandbox.kill(str(handle.ref), pid)
        return self._ended(handle, code)

    def close(self) -> None:
        self.sandbox.close()  # its scope, if no workload is left in it

    def _ended(self, handle: Handle, fallback: int | None) -> Exit:
        reason = self.sandbox.finish(str(handle.ref), _pid(handle))
        log_path = self.logs_dir / f"{handle.ref}.log"
        code = _recorded(_exit_path(log_path), fallback)
        if code == SETUP_FAILED and reason is None:  # its working dir: the log says why
            return Exit(None, f"could not start: {last_line(log_path)}")
        if code is None and reason is None:  # vanished: the platform's failure, not its own
            return Exit(None, "process lost", lost=True)
        return Exit(code, reason)


def _pid(handle: Handle) -> int:
    return int(handle.token.partition(":")[0])


def _exit_path(log_path: Path) -> Path:
    return Path(f"{log_path}.exit")


def _start_time(pid: int) -> float | None:
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None  # ended; its parent has yet to reap it
        return proc.create_time()
    except psutil.Error:
        return None


def _recorded(exit_path: Path, fallback: int | None) -> int | None:
    try:
        return int(exit_path.read_text().strip())
    except (OSError, ValueError):
        return fallback
