"""`python -m gpucloud.control.sandbox.run SPECFILE [NAME]`: run one workload in the sandbox,
wait for it and exit with its exit code. For an engine that starts one process per node and
takes that process for the workload (a Slurm job's srun task): the process the engine
signals, waits for and kills.

SPECFILE is the 0600 JSON file `write_spec_file` made: the workload's Spec, the cgroup
scope, and the names of variables the workload inherits from this process's environment
when set (its node's rank, the GPUs the engine gave it, the engine's job id). NAME, when
given, names the sandbox (its cgroups) on this node instead of the Spec: each node of a
gang has its own, so that two of its nodes on one machine do not take each other's.

This process stays where the engine put it (the engine's cgroups: Slurm's proctrack
signals and kills what they hold) and moves the workload into the sandbox's. The engine's
signals reach this process, which forwards them to the workload's processes (a SIGTERM
before a time limit or a cancel: the workload saves its checkpoint); when the engine
SIGKILLs it, the workload dies with it (`Sandbox.start(die_with_parent=True)`). Killed so,
it cannot remove the workload's empty cgroups: the next workload of the same name does.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import asdict, replace
from pathlib import Path

from . import SETUP_FAILED, Identity, Limits, Sandbox, SandboxError, Spec

# What an engine sends a running workload: forwarded to it.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_PATHS = ("writable", "readable", "hidden", "devices", "make_dirs")


def write_spec_file(path: Path, scope: str, spec: Spec, inherit: tuple[str, ...] = ()) -> None:
    """Write what the runner needs (secrets among it: 0600, replaced whole)."""
    data = {**asdict(spec), "env": dict(spec.env), "scope": scope, "inherit": list(inherit)}
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, default=str)
    tmp.replace(path)


def read_spec_file(path: Path) -> tuple[str, Spec, tuple[str, ...]]:
    """The scope, the Spec and the inherited names `write_spec_file` wrote."""
    data = json.loads(path.read_text())
    scope, inherit, identity = data.pop("scope"), data.pop("inherit"), data.pop("identity")
    data["identity"] = Identity(**identity) if identity else None
    data["limits"] = Limits(**data["limits"])
    for key in ("cwd", "log_path", "exit_path"):
        data[key] = Path(data[key])
    for key in _PATHS:
        data[key] = tuple(map(Path, data[key]))
    return scope, Spec(**data), tuple(inherit)


def run(spec_file: Path, name: str | None = None) -> int:
    """Run the workload of `spec_file` (its sandbox called `name`, if given) to its end; its
    exit code (SETUP_FAILED when its sandbox could not be set up, with the reason on
    stderr)."""
    try:
        scope, spec, inherit = read_spec_file(spec_file)
        env = {**spec.env, **{k: os.environ[k] for k in inherit if k in os.environ}}
        spec = replace(spec, env=env, name=name or spec.name)
        sandbox = Sandbox(scope)
        proc = sandbox.start(spec, die_with_parent=True)
    except (OSError, ValueError, TypeError, KeyError, SandboxError) as e:
        print(f"gpucloud sandbox: could not start: {e}", file=sys.stderr)
        return SETUP_FAILED
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _: sandbox.signal(spec.name, proc.pid, s))
    code = proc.wait()
    reason = sandbox.finish(spec.name, proc.pid)
    sandbox.close()
    if reason:
        print(f"gpucloud sandbox: {reason}", file=sys.stderr)
    return 128 - code if code < 0 else code  # killed by a signal: as a shell reports it


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(f"usage: python -m {__spec__.name} SPECFILE [NAME]")
    sys.exit(run(Path(sys.argv[1]), *sys.argv[2:]))
