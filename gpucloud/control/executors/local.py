"""The local executor: each workload runs on this machine in a sandbox of its tenant
(gpucloud.control.sandbox): its own user, namespaces and cgroup.

The sandbox records the command's exit code in a file when it ends, so a control plane
restarted after a crash learns how an adopted workload ended even though it is not that
process's parent. A workload is identified by its cgroup, named after its log file
(job-12, replica-5): a restarted control plane finds it again by that name alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from gpucloud.control.sandbox import SETUP_FAILED, Identity, Limits, Sandbox, SandboxError, Spec

# What the shell's exit code says beyond its number.
_SHELL_CODES = {126: "command not executable", 127: "command not found"}


class StartError(Exception):
    """The workload could not even start (its working dir, environment or log file): a
    failed attempt of the workload, whose message says why."""


@dataclass(frozen=True, slots=True)
class Launch:
    """What to run: a shell command with its environment, working dir and log file, the
    directories it is promised (a job's checkpoint dir), made by the workload's own user
    before its command starts, and its sandbox: the user it runs as, the dirs it may write
    and read, its limits."""

    command: str
    env: dict[str, str]
    cwd: Path
    log_path: Path
    make_dirs: tuple[Path, ...] = ()
    identity: Identity | None = None
    writable: tuple[Path, ...] = ()
    readable: tuple[Path, ...] = ()
    hidden: tuple[Path, ...] = ()
    devices: tuple[Path, ...] = ()  # device nodes (its GPUs) bound into the sandbox's /dev
    limits: Limits = field(default_factory=Limits)
    network: bool = True

    @property
    def name(self) -> str:
        return self.log_path.stem  # job-12: unique among the workloads of a control plane


@dataclass(frozen=True, slots=True)
class Handle:
    name: str
    pid: int
    start_time: float
    exit_path: str

    @property
    def log_path(self) -> Path:
        return Path(self.exit_path.removesuffix(".exit"))


@dataclass(frozen=True, slots=True)
class Exit:
    """How a workload ended; `code` is None when it vanished without recording one;
    `reason` says when its sandbox ended it ("out of memory: limit 1 GiB")."""

    code: int | None
    reason: str | None = None


class LocalExecutor:
    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self._children: dict[int, subprocess.Popen] = {}

    def start(self, launch: Launch) -> Handle:
        """Start the command in its sandbox, output appended to its log file (0600).
        Raises StartError if it cannot be started (a missing command starts, and exits
        127)."""
        exit_path = f"{launch.log_path}.exit"
        try:
            launch.log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.close(os.open(launch.log_path, os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o600))
            proc = self.sandbox.start(
                Spec(
                    name=launch.name,
                    command=launch.command,
                    env=launch.env,
                    cwd=launch.cwd,
                    make_dirs=launch.make_dirs,
                    log_path=launch.log_path,
                    exit_path=Path(exit_path),
                    identity=launch.identity,
                    writable=launch.writable,
                    readable=launch.readable,
                    hidden=launch.hidden,
                    devices=launch.devices,
                    limits=launch.limits,
                    network=launch.network,
                )
            )
        except (OSError, ValueError, SandboxError) as e:  # ValueError: a NUL byte
            raise StartError(str(e)) from e
        self._children[proc.pid] = proc
        return Handle(launch.name, proc.pid, _start_time(proc.pid) or time.time(), exit_path)

    def poll(self, handle: Handle) -> Exit | None:
        """None while the workload runs; its Exit once it ended (its sandbox torn down)."""
        child = self._children.get(handle.pid)
        if child is not None:
            code = child.poll()
            if code is None:
                return None
            del self._children[handle.pid]
            return self._ended(handle, code)
        if self.alive(handle):
            return None
        return self._ended(handle, None)

    def alive(self, handle: Handle) -> bool:
        """Whether anything of the workload still runs (its cgroup holds a process)."""
        return self.sandbox.running(handle.name, handle.pid)

    def stop(self, handle: Handle, grace: float) -> Exit:
        """SIGTERM every process of the workload, SIGKILL all after `grace` seconds; wait
        until nothing of it is left."""
        self.sandbox.stop(handle.name, handle.pid, grace)
        child = self._children.pop(handle.pid, None)
        code = child.wait() if child is not None else None
        return self._ended(handle, code)

    def _ended(self, handle: Handle, fallback: int | None) -> Exit:
        reason = self.sandbox.finish(handle.name, handle.pid)
        code = _recorded(handle.exit_path, fallback)
        if code == SETUP_FAILED and reason is None:  # its working dir: the log says why
            return Exit(None, f"could not start: {_last_line(handle.log_path)}")
        return Exit(code, reason)


def _last_line(path: Path) -> str:
    """The last non-empty line of a log (what the sandbox's set-up printed last)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return "its sandbox could not be set up"
    return next((line for line in reversed(lines) if line.strip()), "")[:500]


def describe_exit(code: int | None) -> str:
    """'exit code 127 (command not found)', 'exit code 137 (SIGKILL)', 'exit code 3'."""
    if code is None:
        return "exit code unknown"
    meaning = _SHELL_CODES.get(code)
    if code > 128:  # the shell's way of saying that a signal ended the command
        with contextlib.suppress(ValueError):
            meaning = signal.Signals(code - 128).name
    return f"exit code {code}" + (f" ({meaning})" if meaning else "")


def _start_time(pid: int) -> float | None:
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None  # ended; its parent has yet to reap it
        return proc.create_time()
    except psutil.Error:
        return None


def _recorded(exit_path: str, fallback: int | None) -> int | None:
    try:
        return int(Path(exit_path).read_text().strip())
    except (OSError, ValueError):
        return fallback
