"""Run a tenant's workload as an isolated process tree: its own uid, mount, PID and IPC
namespaces, a cgroup that enforces its CPU, memory and process limits.

A workload is untrusted code. It starts as

    sh WRAPPER (the server's user: root in multi-tenant mode)
      → bwrap (namespaces: the system read-only, a private /tmp, the hidden dirs covered,
               the tenant's dirs read-write, a fresh /proc, a fresh environment)
      → setpriv (the tenant's uid/gid, no capabilities, no new privileges) → sh -c CMD

bwrap runs as root so that it needs no user namespace (often disabled for unprivileged
users) and resolves the tenant's dirs with root's access; it hands the command only the
capabilities setpriv needs to become the tenant, which setpriv then drops for good.

The wrapper writes its own pid into the workload's cgroups before it starts anything, so
every process of the workload is born inside them (no window in which a fork escapes),
and records the command's exit code in a file, so that a restarted control plane learns
how an adopted workload ended. The cgroup, not a process group, is what identifies a
workload and what is killed at its end: children that called setsid or double-forked
die with it. The PID namespace adds a second net: when the workload's main process ends,
the kernel kills whatever else it left in its namespace.

Imports nothing of gpucloud: every executor (local, Ray, Slurm) goes through it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .cgroups import Cgroups, Limits, format_bytes, signal_quietly
from .mounts import Mounts, installation

__all__ = [
    "SETUP_FAILED",
    "Identity",
    "Limits",
    "Sandbox",
    "SandboxError",
    "Spec",
    "format_bytes",
    "scope_for",
]

log = logging.getLogger(__name__)
# $1 = exit-code file, $2 = how many cgroup.procs files follow, then those files, then argv.
_WRAPPER = (
    'exit_path=$1; n=$2; shift 2; while [ "$n" -gt 0 ]; do '
    'echo $$ > "$1" || { echo "gpucloud sandbox: cannot enter cgroup $1" >&2; exit 125; }; '
    "shift; n=$((n - 1)); done; "
    '"$@"; code=$?; echo $code > "$exit_path.tmp" && mv "$exit_path.tmp" "$exit_path"; '
    "exit $code"
)
# Inside the sandbox, as the workload's user: $1 = command, $2 = working dir, then the dirs
# to make. Made by the workload's own user, never by root: a root mkdir inside a dir the
# tenant owns would follow the tenant's symlinks anywhere.
_SETUP = (
    'cmd=$1; cwd=$2; shift 2; if ! err=$(mkdir -p -- "$cwd" "$@" 2>&1 && cd -- "$cwd" 2>&1); '
    'then echo "gpucloud sandbox: ${err:-cannot enter $cwd}" >&2; exit 125; fi; '
    'cd -- "$cwd" && unset OLDPWD && exec /bin/sh -c "$cmd"'
)
# The exit code of a workload whose sandbox could not be set up (docker run's convention);
# the log's last line says why.
SETUP_FAILED = 125


class SandboxError(Exception):
    """The sandbox cannot be set up on this machine, or a spec asks for what it forbids."""


@dataclass(frozen=True, slots=True)
class Identity:
    """The OS user and group a workload runs as."""

    uid: int
    gid: int


def default_path() -> str:
    """The workload's PATH: this installation's venv, then the system's."""
    return f"{Path(sys.executable).parent}:/usr/bin:/bin"


@dataclass(frozen=True, slots=True)
class Spec:
    """One workload. `name` names its cgroup: unique among the workloads that run at once."""

    name: str
    command: str  # run by /bin/sh -c inside the sandbox
    env: Mapping[str, str]  # the whole environment, besides PATH
    cwd: Path  # made (with make_dirs) by the workload's user before the command starts
    log_path: Path  # stdout and stderr, opened by the server (the workload gets the fd)
    exit_path: Path  # where the wrapper records the exit code
    identity: Identity | None = None  # None = the server's own user (refused for root)
    # Bound at the same path; bwrap resolves them with the server's access, so a caller
    # passes only dirs the tenant may use (its area, an admin's export, a checked model dir).
    writable: tuple[Path, ...] = ()  # read-write
    readable: tuple[Path, ...] = ()  # read-only (e.g. a model dir inside a hidden one)
    hidden: tuple[Path, ...] = ()  # covered by an empty tmpfs (the control plane's home)
    devices: tuple[Path, ...] = ()  # device nodes bound into the sandbox's /dev
    make_dirs: tuple[Path, ...] = ()
    limits: Limits = field(default_factory=Limits)
    network: bool = True  # False = own network namespace, loopback only
    path: str = field(default_factory=default_path)


class Sandbox:
    """Starts, watches and ends the workloads of one control plane: their cgroups live
    under `scope` (e.g. "gpucloud/<id of this control plane>") in every controller used."""

    def __init__(self, scope: str) -> None:
        self.scope = scope
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxError(
                "bubblewrap is not installed: install Debian's `bubblewrap` package (bwrap)"
            )
        self.bwrap = os.path.realpath(bwrap)  # as /proc/PID/exe names it
        self.setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
        self.installation = installation()
        self.cgroups = Cgroups.detect(scope)
        if self.cgroups is None:
            log.warning("no writable cgroups: workloads' CPU, memory and pids limits not enforced")

    def start(self, spec: Spec, die_with_parent: bool = False) -> subprocess.Popen:
        """Start the workload; raises OSError/ValueError/SandboxError if it cannot start.
        `die_with_parent`: the workload is SIGKILLed when this process dies (for a process
        that is the workload to an engine which may SIGKILL it, e.g. Slurm's task)."""
        argv = [*self._bwrap(spec), *self._privileges(spec.identity), "/bin/sh", "-c", _SETUP]
        argv += ["gpucloud-workload", spec.command, str(spec.cwd), *map(str, spec.make_dirs)]
        cgroup_procs = self.cgroups.create(spec.name, spec.limits) if self.cgroups else []
        # bwrap's --die-with-parent then takes everything in its PID namespace along
        orphaned = [self.setpriv, "--pdeathsig", "KILL"] if die_with_parent else []
        wrapper = [*orphaned, "/bin/sh", "-c", _WRAPPER, "gpucloud-sandbox", str(spec.exit_path)]
        wrapper += [str(len(cgroup_procs)), *map(str, cgroup_procs), *argv]
        spec.exit_path.unlink(missing_ok=True)
        try:
            with spec.log_path.open("ab") as out:
                return subprocess.Popen(
                    wrapper,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={"PATH": "/usr/bin:/bin"},
                    start_new_session=True,  # the fallback to stop it when there is no cgroup
                )
        except BaseException:
            self.remove(spec.name)
            raise

    def close(self) -> None:
        """Remove this control plane's cgroup scope, once none of its workloads is left."""
        if self.cgroups:
            self.cgroups.close()

    def running(self, name: str, pid: int) -> bool:
        """Whether anything of the workload still runs (its cgroup holds a process; without
        cgroups: its wrapper `pid` lives)."""
        if self.cgroups:
            return bool(self.cgroups.members(name))
        return _alive(pid)

    def stop(self, name: str, pid: int, grace: float) -> None:
        """SIGTERM every process of the workload (not the sandbox's own), SIGKILL all after
        `grace` seconds, wait until nothing of it is left."""
        self.signal(name, pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.running(name, pid):
            time.sleep(0.05)
        self.kill(name, pid)

    def signal(self, name: str, pid: int, sig: int) -> None:
        """Send `sig` to every process of the workload (not the sandbox's own, whose end
        would SIGKILL the workload at once), and SIGCONT: a stopped process gets to
        handle it."""
        for p in self._workload_processes(name, pid):
            signal_quietly(p, sig)
            signal_quietly(p, signal.SIGCONT)

    def kill(self, name: str, pid: int) -> None:
        """SIGKILL everything of the workload and wait until it is gone."""
        if self.cgroups:
            self.cgroups.kill(name)
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # the PID namespace dies with bwrap

    def finish(self, name: str, pid: int) -> str | None:
        """Tear the workload's sandbox down (killing any leftover) and say why it failed
        when that was the cgroup's doing ("out of memory: limit 1 GiB"), else None."""
        self.kill(name, pid)
        return self.remove(name)

    def remove(self, name: str) -> str | None:
        """Remove the workload's (empty) cgroups; the OOM kill they saw, if any."""
        return self.cgroups.remove(name) if self.cgroups else None

    def _workload_processes(self, name: str, pid: int) -> list[int]:
        """The processes to SIGTERM: the workload's own, not the wrapper or bwrap (killing
        those would SIGKILL the namespace at once, denying the workload its grace)."""
        members = self.cgroups.members(name) if self.cgroups else _group(pid)
        return [p for p in members if p != pid and _exe(p) != self.bwrap]

    def _privileges(self, identity: Identity | None) -> list[str]:
        """The command that drops to the tenant's user inside the sandbox, once bwrap (as
        root: no user namespace needed, bind sources resolved with root's access) has
        mounted everything."""
        if os.geteuid() != 0:
            if identity is not None and (identity.uid, identity.gid) != (os.getuid(), os.getgid()):
                raise SandboxError("only root can run a workload as another user")
            return []
        if identity is None or identity.uid == 0:
            raise SandboxError("a workload never runs as root: give it a tenant's identity")
        return [
            self.setpriv,
            f"--reuid={identity.uid}",
            f"--regid={identity.gid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
        ]

    def _bwrap(self, spec: Spec) -> list[str]:
        mounts = Mounts()
        for d in spec.hidden:
            mounts.hide(d)
        for d in spec.devices:
            mounts.device(d)
        for d in spec.writable:
            mounts.bind(d, writable=True)
        for d in [*self.installation, *spec.readable]:
            mounts.bind(d, writable=False)
        args = [self.bwrap, *mounts.args]
        args += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent"]
        if os.geteuid() == 0:  # what setpriv needs to switch to the tenant, then drops
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
            args += ["--cap-add", "CAP_SETPCAP"]
        if not spec.network:
            args.append("--unshare-net")
        args += ["--clearenv", "--setenv", "PATH", spec.path]
        for key, value in spec.env.items():
            if not key or "=" in key:
                raise SandboxError(f"{key!r} is not an environment variable name (no '=')")
            if key != "PATH":
                args += ["--setenv", key, value]
        return args


def scope_for(home: Path) -> str:
    """A cgroup scope unique to one control plane (its home), so that several on one
    machine never share a workload's cgroup name."""
    return "gpucloud/" + hashlib.sha256(str(Path(home).resolve()).encode()).hexdigest()[:12]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _group(pid: int) -> list[int]:
    """The processes of process group `pid` (the fallback without cgroups)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError), open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) == pid:
                    found.append(int(entry))
    return found


def _exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None
