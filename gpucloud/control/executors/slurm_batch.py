"""The batch script and `sbatch` options that run one placed workload as one Slurm job.

The job asks Slurm for exactly the placement our scheduler chose (`--nodelist`, one task per
node, each node's GPU count), so Slurm's queue only ever holds what the control plane
admitted. The script exports the workload's env (secrets included: the script is a 0600
file that `sbatch` hands to slurmctld, never a command line), then `srun` starts one task per
node; each task picks its node's part of the placement by its Slurm node name, so rank 0
runs on `parts[0]`, the rendezvous master the scheduler chose, whatever order Slurm lists
the nodes in. Slurm pins the GPUs itself (its GRES plugin sets CUDA_VISIBLE_DEVICES and the
like to the devices it allocated), so the placement's own device env is left out.
"""

from __future__ import annotations

import math
import shlex

from gpucloud.control.executors.base import Launch, NodePart, StartError
from gpucloud.hal.device import BACKENDS

# The device env our scheduler computes per node: Slurm's allocation decides it instead.
_DEVICE_ENV = frozenset(b.visible_devices_env for b in BACKENDS.values() if b.visible_devices_env)
# Seconds before a time limit at which every task gets SIGTERM, so a training job saves a
# checkpoint (the same signal a stop sends) before Slurm kills it.
SIGNAL_BEFORE_LIMIT = 60


def job_name(launch: Launch) -> str:
    return f"gpucloud-{launch.ref}"


def sbatch_args(launch: Launch) -> list[str]:
    """`sbatch` options for the launch (the script file is appended by the caller).
    Raises StartError for a placement Slurm cannot express."""
    parts = launch.parts
    if not parts:
        raise StartError("a Slurm job needs a placement on at least one node")
    gpus = {len(p.devices) for p in parts}
    if len(gpus) > 1:
        raise StartError(
            f"Slurm gives every node of a job the same GPU count; the placement has {sorted(gpus)}"
        )
    args = [
        "--parsable",
        f"--job-name={job_name(launch)}",
        f"--nodes={len(parts)}",
        f"--nodelist={','.join(p.node for p in parts)}",
        "--ntasks-per-node=1",
        f"--output={launch.log_path}",
        "--open-mode=append",
        # the job's environment is the script's: nothing of the control plane's own leaks in
        "--export=NONE",
        "--requeue",  # a node failure or a preemption requeues it rather than failing it
        f"--signal=TERM@{SIGNAL_BEFORE_LIMIT}",  # to every task, as a stop does
    ]
    if (n := gpus.pop()) > 0:
        args.append(f"--gres=gpu:{n}")
    if launch.limits.cpus is not None:
        args.append(f"--cpus-per-task={max(1, math.ceil(launch.limits.cpus))}")
    if launch.limits.memory_bytes is not None:
        args.append(f"--mem={max(1, launch.limits.memory_bytes // 2**20)}M")
    return args


def batch_script(launch: Launch) -> str:
    """The batch script: the common env, then one task per node through srun (which ends
    every task when one of them fails: a gang lives and dies together)."""
    lines = ["#!/bin/sh", f"# {launch.ref}, written by gpucloud's Slurm executor"]
    lines += _exports(launch.env)
    srun = [
        "srun",
        "--export=ALL",  # the batch env above, into every task
        f"--nodes={len(launch.parts)}",
        f"--ntasks={len(launch.parts)}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
    ]
    lines.append(f"exec {shlex.join(srun)} /bin/sh -c {shlex.quote(task_script(launch))}")
    return "\n".join(lines) + "\n"


def task_script(launch: Launch) -> str:
    """What each task runs: its node's env, the promised dirs, the working dir, the command."""
    cases = [f"  {shlex.quote(p.node)}) {' '.join(_node_exports(p))} ;;" for p in launch.parts]
    unknown = 'echo "gpucloud: node $SLURMD_NODENAME is not in this placement" >&2; exit 1'
    dirs = " ".join(shlex.quote(str(d)) for d in (*launch.make_dirs, launch.cwd))
    return "\n".join(
        [
            'case "$SLURMD_NODENAME" in',
            *cases,
            f"  *) {unknown} ;;",
            "esac",
            f"mkdir -p -- {dirs} && cd -- {shlex.quote(str(launch.cwd))} || exit 1",
            launch.command,
        ]
    )


def _node_exports(part: NodePart) -> list[str]:
    env = {k: v for k, v in part.env.items() if k not in _DEVICE_ENV}
    return [f"export {line};" for line in _assignments(env)] or [":"]


def _exports(env: dict[str, str]) -> list[str]:
    return [f"export {line}" for line in _assignments(env)]


def _assignments(env: dict[str, str]) -> list[str]:
    out = []
    for key, value in sorted(env.items()):
        if not key.isidentifier() or not key.isascii():
            raise StartError(f"environment variable name {key!r} is not a shell name")
        if "\0" in value:
            raise StartError(f"environment variable {key} holds a NUL byte")
        out.append(f"{key}={shlex.quote(value)}")
    return out
