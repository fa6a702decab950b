"""One cgroup per workload: v2 (one hierarchy) or v1 (one per controller), enforcing its
memory, CPU and process limits, killed whole, and telling whether it ended out of memory."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
_CFS_PERIOD_US = 100_000


@dataclass(frozen=True, slots=True)
class Limits:
    """What the cgroup enforces; None = no limit."""

    cpus: float | None = None
    memory_bytes: int | None = None
    pids: int | None = None


class Cgroups:
    """One cgroup per workload, in cgroup v2 (one hierarchy) or v1 (one per controller:
    memory, cpu, pids, and freezer to kill a group that forks while it is killed)."""

    V1_CONTROLLERS = ("memory", "cpu", "pids", "freezer")

    def __init__(self, dirs: dict[str, Path], v2: bool) -> None:
        self.dirs = dirs  # controller (or "unified") → this scope's directory
        self.v2 = v2

    @classmethod
    def detect(cls, scope: str) -> Cgroups | None:
        """The cgroups this process may create under `scope`, or None when it may not."""
        if (CGROUP_ROOT / "cgroup.controllers").exists():
            dirs, v2 = {"unified": CGROUP_ROOT / scope}, True
        else:
            v1 = {c: CGROUP_ROOT / c for c in cls.V1_CONTROLLERS}
            if not all((d / "cgroup.procs").exists() for d in v1.values()):
                return None
            dirs, v2 = {c: d / scope for c, d in v1.items()}, False
        try:
            for d in dirs.values():
                d.mkdir(parents=True, exist_ok=True)
                if v2:
                    _enable_v2_controllers(d)
        except OSError:
            return None
        return cls(dirs, v2)

    def close(self) -> None:
        """Remove this scope's dirs, and their parents that are left empty."""
        for d in self.dirs.values():
            with contextlib.suppress(OSError):
                d.rmdir()
                for parent in d.relative_to(CGROUP_ROOT).parents[:-2]:  # not the controller
                    (CGROUP_ROOT / parent).rmdir()

    def create(self, name: str, limits: Limits) -> list[Path]:
        """Make the workload's cgroups with their limits; their cgroup.procs files."""
        self.remove(name)  # a leftover of a workload of the same name that was never reaped
        paths = {c: d / name for c, d in self.dirs.items()}
        for p in paths.values():
            p.mkdir()
        if self.v2:
            self._limit_v2(paths["unified"], limits)
        else:
            self._limit_v1(paths, limits)
        return [p / "cgroup.procs" for p in paths.values()]

    def members(self, name: str) -> list[int]:
        first = next(iter(self.dirs.values())) / name / "cgroup.procs"
        try:
            return [int(line) for line in first.read_text().split()]
        except OSError:
            return []

    def kill(self, name: str) -> None:
        """SIGKILL every process of the cgroup, frozen first so none forks meanwhile."""
        group = next(iter(self.dirs.values())) / name
        if not group.exists():
            return
        if self.v2 and (group / "cgroup.kill").exists():
            _write(group / "cgroup.kill", "1")
        else:
            freezer = (group if self.v2 else self.dirs["freezer"] / name) / (
                "cgroup.freeze" if self.v2 else "freezer.state"
            )
            _write(freezer, "1" if self.v2 else "FROZEN")
            for pid in self.members(name):
                signal_quietly(pid, signal.SIGKILL)
            _write(freezer, "0" if self.v2 else "THAWED")
        deadline = time.monotonic() + 10
        while self.members(name) and time.monotonic() < deadline:
            for pid in self.members(name):
                signal_quietly(pid, signal.SIGKILL)
            time.sleep(0.01)

    def remove(self, name: str) -> str | None:
        """Remove the workload's (empty) cgroups; the OOM kill they saw, if any."""
        reason = self._oom_reason(name)
        for d in self.dirs.values():
            group = d / name
            for _ in range(100):  # a process that just exited may linger a moment
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
        return reason

    def _oom_reason(self, name: str) -> str | None:
        memory = self.dirs["unified" if self.v2 else "memory"] / name
        try:
            if self.v2:
                counters = (memory / "memory.events").read_text()
                limit = (memory / "memory.max").read_text().strip()
            else:
                counters = (memory / "memory.oom_control").read_text()
                limit = (memory / "memory.limit_in_bytes").read_text().strip()
        except OSError:
            return None
        kills = dict(line.split() for line in counters.splitlines() if line.strip())
        if int(kills.get("oom_kill", 0)) == 0:
            return None
        limit_text = format_bytes(int(limit)) if limit.isdigit() else "none"
        return f"out of memory: limit {limit_text}"

    @staticmethod
    def _limit_v1(paths: dict[str, Path], limits: Limits) -> None:
        if limits.memory_bytes:
            _write(paths["memory"] / "memory.limit_in_bytes", str(limits.memory_bytes))
            swap = paths["memory"] / "memory.memsw.limit_in_bytes"
            if swap.exists():  # memory + swap: a workload may not swap past its limit
                _write(swap, str(limits.memory_bytes))
        if limits.cpus:
            _write(paths["cpu"] / "cpu.cfs_period_us", str(_CFS_PERIOD_US))
            _write(paths["cpu"] / "cpu.cfs_quota_us", str(_quota_us(limits.cpus)))
        if limits.pids:
            _write(paths["pids"] / "pids.max", str(limits.pids))

    @staticmethod
    def _limit_v2(path: Path, limits: Limits) -> None:
        if limits.memory_bytes:
            _write(path / "memory.max", str(limits.memory_bytes))
            with contextlib.suppress(OSError):
                _write(path / "memory.swap.max", "0")
        if limits.cpus:
            _write(path / "cpu.max", f"{_quota_us(limits.cpus)} {_CFS_PERIOD_US}")
        if limits.pids:
            _write(path / "pids.max", str(limits.pids))


def format_bytes(n: int) -> str:
    """'1 GiB', '256 MiB', '1.5 GiB', '4096 bytes'."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size:
            value = n / size
            return f"{value:g} {unit}" if value * 10 == int(value * 10) else f"{value:.1f} {unit}"
    return f"{n} bytes"


def _quota_us(cpus: float) -> int:
    return max(1000, round(cpus * _CFS_PERIOD_US))


def _enable_v2_controllers(scope: Path) -> None:
    """cgroup v2 hands a controller to a child only when each ancestor enables it."""
    for d in [*reversed(scope.relative_to(CGROUP_ROOT).parents), scope.relative_to(CGROUP_ROOT)]:
        control = CGROUP_ROOT / d / "cgroup.subtree_control"
        for c in ("memory", "cpu", "pids"):
            with contextlib.suppress(OSError):
                _write(control, f"+{c}")


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def signal_quietly(pid: int, sig: signal.Signals) -> None:
    """Signal a process that may have ended, or turned out not to be ours."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)
