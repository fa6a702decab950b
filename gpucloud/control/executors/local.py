"""The local executor: each workload is a process session on this machine.

A workload runs under a small shell wrapper that writes the command's exit code to a
file when it ends, so a control plane restarted after a crash learns how an adopted
process ended even though it is not that process's parent. A process is identified by
its pid AND its start time, so a recycled pid is never mistaken for the workload.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

# $1 = the command, $2 = the exit-code file. The command runs in a child shell so that
# `exit` inside it still reaches the line that records the code.
_WRAPPER = '/bin/sh -c "$1"; code=$?; echo $code > "$2.tmp" && mv "$2.tmp" "$2"; exit $code'
# What the shell's exit code says beyond its number.
_SHELL_CODES = {126: "command not executable", 127: "command not found"}


class StartError(Exception):
    """The workload could not even start (its working dir, environment or log file): a
    failed attempt of the workload, whose message says why."""


@dataclass(frozen=True, slots=True)
class Launch:
    """What to run: a shell command with its environment, working dir and log file, and
    the directories it is promised (a job's checkpoint dir), made before it starts."""

    command: str
    env: dict[str, str]
    cwd: Path
    log_path: Path
    make_dirs: tuple[Path, ...] = ()


@dataclass(frozen=True, slots=True)
class Handle:
    pid: int
    start_time: float
    exit_path: str


@dataclass(frozen=True, slots=True)
class Exit:
    """How a process ended; `code` is None when it vanished without recording one."""

    code: int | None


class LocalExecutor:
    def __init__(self) -> None:
        self._children: dict[int, subprocess.Popen] = {}

    def start(self, launch: Launch) -> Handle:
        """Start the command in its own session, output appended to its log file. Raises
        StartError if it cannot be started (a missing command starts, and exits 127)."""
        exit_path = f"{launch.log_path}.exit"
        try:
            launch.log_path.parent.mkdir(parents=True, exist_ok=True)
            for directory in (launch.cwd, *launch.make_dirs):
                directory.mkdir(parents=True, exist_ok=True)
            Path(exit_path).unlink(missing_ok=True)
            log_fd = os.open(launch.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with open(log_fd, "ab") as log:  # read through the API, by its tenant only
                proc = subprocess.Popen(
                    ["/bin/sh", "-c", _WRAPPER, "gpucloud-workload", launch.command, exit_path],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=launch.cwd,
                    env={**os.environ, **launch.env},
                    start_new_session=True,  # its own process group: stopped as a whole
                )
        except (OSError, ValueError, subprocess.SubprocessError) as e:  # ValueError: a NUL byte
            raise StartError(str(e)) from e
        self._children[proc.pid] = proc
        return Handle(proc.pid, _start_time(proc.pid) or time.time(), exit_path)

    def poll(self, handle: Handle) -> Exit | None:
        """None while the process runs; its Exit once it ended."""
        child = self._children.get(handle.pid)
        if child is not None:
            code = child.poll()
            if code is None:
                return None
            del self._children[handle.pid]
            return Exit(_recorded(handle.exit_path, code))
        if self.alive(handle):
            return None
        return Exit(_recorded(handle.exit_path, None))

    def alive(self, handle: Handle) -> bool:
        """Whether the process that `handle` names still runs (same pid, same start time)."""
        started = _start_time(handle.pid)
        return started is not None and abs(started - handle.start_time) < 1.0

    def stop(self, handle: Handle, grace: float) -> Exit:
        """SIGTERM the process group, SIGKILL it after `grace` seconds; wait until it is gone.
        A stopped (SIGSTOP) group is continued, so that it gets to handle its SIGTERM."""
        if not self.alive(handle):
            return self.poll(handle) or Exit(None)
        _signal_group(handle.pid, signal.SIGTERM)
        _signal_group(handle.pid, signal.SIGCONT)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if (ended := self.poll(handle)) is not None:
                _signal_group(handle.pid, signal.SIGKILL)  # stragglers left in the group
                return ended
            time.sleep(0.05)
        _signal_group(handle.pid, signal.SIGKILL)
        while (ended := self.poll(handle)) is None:
            time.sleep(0.05)
        return ended


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


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
