"""What the reconciler asks of an executor, and the values they exchange.

The reconciler decides what runs where (the scheduler core places every workload on the
nodes the executor reports); an executor only carries that out on its engine — this
machine (local), a Ray cluster or a Slurm cluster — and reports back. Each engine is one
module implementing `Executor`; the reconciler is given one at construction and never
asks which it is.

A running workload is known by a `Handle`: its reference and a token the executor writes
(a pid and start time; a Ray placement group; a Slurm job id). The token is stored with the
job or replica, so a control plane restarted after a crash rebuilds the handle from the
store and polls or stops the workload it did not start: that is adoption.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from gpucloud.control.sandbox import Identity, Limits, Spec

if TYPE_CHECKING:
    from gpucloud.hal.telemetry import Monitor


class WorkloadKind(StrEnum):
    JOB = "job"
    REPLICA = "replica"


@dataclass(frozen=True, order=True, slots=True)
class WorkloadRef:
    """A job or a replica. `str(ref)` ("job-12") is its id in the scheduler core and the
    name of its log file and cgroup: unique among the workloads of a control plane."""

    kind: WorkloadKind
    id: int

    def __str__(self) -> str:
        return f"{self.kind}-{self.id}"

    @classmethod
    def parse(cls, text: str) -> WorkloadRef:
        kind, _, num = text.partition("-")
        if not num.isdigit():
            raise ValueError(f"not a workload reference: {text!r} (job-N or replica-N)")
        return cls(WorkloadKind(kind), int(num))

    @classmethod
    def job(cls, job_id: int) -> WorkloadRef:
        return cls(WorkloadKind.JOB, job_id)

    @classmethod
    def replica(cls, replica_id: int) -> WorkloadRef:
        return cls(WorkloadKind.REPLICA, replica_id)


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One node as its executor reports it, every pass."""

    name: str
    gpu_type: str  # a hardware-catalog name
    gpus: int
    backend: str  # the hal backend of its accelerators (cpu for virtual slots)
    address: str  # where its workloads are reached: replica URLs, rendezvous
    cpu_milli: int = 0  # what it offers to workloads; 0 = not tracked
    memory_mib: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    healthy: bool = True
    reason: str | None = None  # why it is not healthy, in the engine's words


@dataclass(frozen=True, slots=True)
class NodePart:
    """One node's share of the placement the scheduler chose."""

    node: str
    address: str
    devices: tuple[int, ...]  # accelerator indices on that node
    # Added to the launch's env on this node: its device env, and for a workload on several
    # nodes GPUCLOUD_NODE_RANK, GPUCLOUD_NODE_ADDR, GPUCLOUD_NNODES, GPUCLOUD_MASTER_ADDR,
    # GPUCLOUD_MASTER_PORT.
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Launch:
    """What to run: a shell command, the same on every node of its placement, with its
    environment, working dir and log file (the executor appends the output of every node
    and rank there); the dirs it is promised (a job's checkpoint dir), made by the
    workload's own user before its command starts; and its sandbox: the user it runs as,
    the dirs it may write and read, its device nodes, its limits."""

    ref: WorkloadRef
    command: str
    env: dict[str, str]
    cwd: Path
    log_path: Path
    parts: tuple[NodePart, ...]  # parts[0] is the rendezvous master
    make_dirs: tuple[Path, ...] = ()
    identity: Identity | None = None
    writable: tuple[Path, ...] = ()
    readable: tuple[Path, ...] = ()
    hidden: tuple[Path, ...] = ()
    devices: tuple[Path, ...] = ()  # device nodes (its GPUs) bound into the sandbox's /dev
    limits: Limits = field(default_factory=Limits)
    network: bool = True
    port: int | None = None  # a replica's serving port, on parts[0].address
    time_limit: float | None = None  # seconds the run may last (the control plane stops it)

    def sandbox_spec(self, name: str, env: dict[str, str], log_path: Path, exit_path: Path) -> Spec:
        """The sandbox's spec of this launch on one node: named `name` (its cgroup), with
        `env` (the launch's and its node's), output and exit code in the given files."""
        return Spec(
            name=name,
            command=self.command,
            env=env,
            cwd=self.cwd,
            make_dirs=self.make_dirs,
            log_path=log_path,
            exit_path=exit_path,
            identity=self.identity,
            writable=self.writable,
            readable=self.readable,
            hidden=self.hidden,
            devices=self.devices,
            limits=self.limits,
            network=self.network,
        )


@dataclass(frozen=True, slots=True)
class Handle:
    ref: WorkloadRef
    token: str  # the executor's own record of the running workload (stored in its row)


@dataclass(frozen=True, slots=True)
class Exit:
    """How a workload ended. `code` is None when unknown (it vanished); `reason` says when
    its platform ended it ("out of memory: limit 1 GiB", "node n2 died"); `lost` when the
    platform, not the workload, ended it: a job is then requeued without using a retry."""

    code: int | None
    reason: str | None = None
    lost: bool = False


class StartError(Exception):
    """The workload could not even start (its working dir, environment, placement): a
    failed attempt of the workload, whose message says why."""


class Executor(Protocol):
    name: str  # "local", "ray", "slurm"
    telemetry: Monitor | None  # its node's device telemetry, when it reads it (local only)

    def inventory(self) -> list[NodeInfo]:
        """Every node of the engine, with its health; called once per reconciler pass."""
        ...

    def start(self, launch: Launch) -> Handle:
        """Start the workload on `launch.parts`. Raises StartError."""
        ...

    def poll(self, handle: Handle) -> Exit | None:
        """None while it runs, its Exit once it ended (also for a handle rebuilt from a
        stored token by a restarted control plane)."""
        ...

    def stop(self, handle: Handle, grace: float) -> Exit:
        """SIGTERM every process of it on every node, SIGKILL after `grace` seconds; return
        once nothing of it is left and its resources are free."""
        ...

    def close(self) -> None:
        """The control plane exits; the workloads keep running (adopted by the next)."""
        ...


# What the shell's exit code says beyond its number.
_SHELL_CODES = {126: "command not executable", 127: "command not found"}
# And `gpucloud train`'s (gpucloud.train.launcher.ExitCode), for jobs with a train config.
_TRAIN_CODES = {
    3: "stopped by its health policy",
    4: "a rank hung: retryable, the next attempt resumes from the last checkpoint",
}


def describe_exit(code: int | None, train: bool = False) -> str:
    """'exit code 127 (command not found)', 'exit code 137 (SIGKILL)', 'exit code 3'; with
    `train`, the meaning of `gpucloud train`'s own codes ('exit code 4 (a rank hung: ...)')."""
    if code is None:
        return "exit code unknown"
    meaning = (_TRAIN_CODES if train else {}).get(code) or _SHELL_CODES.get(code)
    if code > 128:  # the shell's way of saying that a signal ended the command
        with contextlib.suppress(ValueError):
            meaning = signal.Signals(code - 128).name
    return f"exit code {code}" + (f" ({meaning})" if meaning else "")


def last_line(path: Path, starting: str = "") -> str:
    """The last non-empty line of a log starting with `starting` (what the sandbox's set-up
    printed last, before lines its engine may add, as srun does), else its last line."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return "its sandbox could not be set up"
    lines = [line for line in lines if line.strip()] or [""]
    found = next((line for line in reversed(lines) if line.startswith(starting)), lines[-1])
    return found[:500]
