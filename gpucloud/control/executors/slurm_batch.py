"""The batch script and `sbatch` options that run one placed workload as one Slurm job.

The job asks Slurm for exactly the placement our scheduler chose (`--nodelist`, one task per
node, each node's GPU count), so Slurm's queue only ever holds what the control plane
admitted. `srun` starts one task per node; each task picks its node's part of the placement
by its Slurm node name, so rank 0 runs on `parts[0]`, the rendezvous master the scheduler
chose, whatever order Slurm lists the nodes in.

Each task is the sandbox's runner (`python -m gpucloud.control.sandbox.run SPECFILE`),
which starts the workload in its tenant's sandbox (own uid, namespaces, cgroup), forwards
Slurm's signals to it and exits with its exit code. SPECFILE (0600, beside the log, so on
the storage Slurm's --output already needs the nodes to share) holds the workload's env,
secrets included: neither the script nor a command line does. Slurm pins the GPUs itself
(its GRES plugin sets CUDA_VISIBLE_DEVICES and the like to the devices it allocated): the
workload inherits those variables from the task, and the placement's own device env is
left out.

The workload runs in the installation the control plane runs from (its Python, at the same
path on every node: a shared or identical install, as `gpucloud train run` needs anyway).
"""

from __future__ import annotations

import math
import shlex
import sys
from pathlib import Path

from gpucloud.control.executors.base import Launch, NodePart, StartError
from gpucloud.control.sandbox import Spec
from gpucloud.hal.device import BACKENDS

# The device env our scheduler computes per node: Slurm's allocation decides it instead.
_DEVICE_ENV = frozenset(b.visible_devices_env for b in BACKENDS.values() if b.visible_devices_env)
# What of Slurm's task env a workload sees: which job and restart it is, where it runs.
_SLURM_ENV = (
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_NUM_NODES",
    "SLURM_NODEID",
    "SLURM_PROCID",
    "SLURM_RESTART_COUNT",
    "SLURM_JOB_GPUS",
    "SLURMD_NODENAME",
)
# Seconds before a time limit at which every task gets SIGTERM, so a training job saves a
# checkpoint (the same signal a stop sends) before Slurm kills it.
SIGNAL_BEFORE_LIMIT = 60
# A training job without a time limit gets one from the planner's estimate of its steps:
# the planner assumes its MFU on every step, so twice that, plus the start (install checks,
# rendezvous, loading the data and the model), at most a week.
PLANNED_MARGIN = 2.0
PLANNED_START = 600
PLANNED_CAP = 7 * 86400


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
    if (minutes := time_minutes(launch)) is not None:
        args.append(f"--time={minutes}")
    if launch.limits.cpus is not None:
        args.append(f"--cpus-per-task={max(1, math.ceil(launch.limits.cpus))}")
    if launch.limits.memory_bytes is not None:
        args.append(f"--mem={max(1, launch.limits.memory_bytes // 2**20)}M")
    return args


def time_minutes(launch: Launch) -> int | None:
    """Slurm's time limit for the launch, in whole minutes; None for none (Slurm's
    partition default). The control plane stops a run at its own limit; Slurm's is the
    backstop, its TERM a minute before the end: TERM no earlier than the limit. Without a
    limit, a training run gets the planner's estimate with a margin (PLANNED_*)."""
    if launch.time_limit is not None:
        return math.ceil((launch.time_limit + SIGNAL_BEFORE_LIMIT) / 60)
    if launch.planned_seconds is not None:
        planned = PLANNED_MARGIN * launch.planned_seconds + PLANNED_START
        return math.ceil(min(planned + SIGNAL_BEFORE_LIMIT, PLANNED_CAP) / 60)
    return None


def spec_file(launch: Launch) -> Path:
    """Where the task's runner reads the workload's sandbox spec (beside its log)."""
    return Path(f"{launch.log_path}.sandbox.json")


def sandbox_spec(launch: Launch) -> tuple[Spec, tuple[str, ...]]:
    """The workload's sandbox, the same on every node, and the names of the variables it
    inherits from its node's task: its part's env and Slurm's."""
    env = _checked({k: v for k, v in launch.env.items() if k not in _DEVICE_ENV})
    log = launch.log_path
    spec = launch.sandbox_spec(str(launch.ref), env, log, Path(f"{log}.exit"))
    per_node = {k for p in launch.parts for k in p.env} - _DEVICE_ENV
    return spec, (*sorted(per_node), *sorted(_DEVICE_ENV), *_SLURM_ENV)


def batch_script(launch: Launch) -> str:
    """The batch script: one task per node through srun (which ends every task when one of
    them fails: a gang lives and dies together)."""
    srun = [
        "srun",
        "--export=ALL",  # Slurm's job env, into every task
        f"--nodes={len(launch.parts)}",
        f"--ntasks={len(launch.parts)}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
    ]
    return "\n".join(
        [
            "#!/bin/sh",
            f"# {launch.ref}, written by gpucloud's Slurm executor",
            f"exec {shlex.join(srun)} /bin/sh -c {shlex.quote(task_script(launch))}",
            "",
        ]
    )


def task_script(launch: Launch) -> str:
    """What each task runs: its node's env, then the workload in its sandbox, named after
    the node's rank too when there are several (`ref-nodeRANK`, as on Ray: two nodes of a
    gang may be one machine, whose cgroups they share)."""
    several = len(launch.parts) > 1
    cases = []
    for rank, part in enumerate(launch.parts):
        name = [f"name={shlex.quote(f'{launch.ref}-node{rank}')};"] if several else []
        cases.append(f"  {shlex.quote(part.node)}) {' '.join([*_node_exports(part), *name])} ;;")
    unknown = 'echo "gpucloud: node $SLURMD_NODENAME is not in this placement" >&2; exit 1'
    runner = [sys.executable, "-m", "gpucloud.control.sandbox.run", str(spec_file(launch))]
    return "\n".join(
        [
            'case "$SLURMD_NODENAME" in',
            *cases,
            f"  *) {unknown} ;;",
            "esac",
            f"exec {shlex.join(runner)}" + (' "$name"' if several else ""),
        ]
    )


def _node_exports(part: NodePart) -> list[str]:
    env = {k: v for k, v in part.env.items() if k not in _DEVICE_ENV}
    return [f"export {line};" for line in _assignments(env)] or [":"]


def _assignments(env: dict[str, str]) -> list[str]:
    return [f"{key}={shlex.quote(value)}" for key, value in sorted(_checked(env).items())]


def _checked(env: dict[str, str]) -> dict[str, str]:
    for key, value in env.items():
        if not key.isidentifier() or not key.isascii():
            raise StartError(f"environment variable name {key!r} is not a shell name")
        if "\0" in value:
            raise StartError(f"environment variable {key} holds a NUL byte")
    return env
