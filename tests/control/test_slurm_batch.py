"""The Slurm batch script of a 2-node placement, its task run by a real shell per node as
Slurm would (the Slurm test cluster has one node: a 2-node job cannot run there): the
workload runs in its tenant's sandbox with its node's rank and Slurm's GPUs."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest

from gpucloud.control.executors.base import Launch, NodePart, StartError, WorkloadRef
from gpucloud.control.executors.slurm_batch import (
    PLANNED_CAP,
    SIGNAL_BEFORE_LIMIT,
    batch_script,
    sandbox_spec,
    sbatch_args,
    spec_file,
    task_script,
    time_minutes,
)
from gpucloud.control.run_estimate import planned_seconds
from gpucloud.control.sandbox import Identity, Sandbox, scope_for
from gpucloud.control.sandbox.run import write_spec_file

UID = 64511  # the tenant's
SHOW = (
    'echo "rank=$GPUCLOUD_NODE_RANK of $GPUCLOUD_NNODES uid=$(id -u)"'
    ' "gpus=${CUDA_VISIBLE_DEVICES:-none} token=$TOKEN $PWD"'
)


def two_node_launch(tmp_path: Path, gpus=(2, 2)) -> Launch:
    def part(rank: int, node: str) -> NodePart:
        env = {"GPUCLOUD_NODE_RANK": str(rank), "GPUCLOUD_NNODES": "2", "CUDA_VISIBLE_DEVICES": "5"}
        return NodePart(node, f"10.0.0.{rank + 1}", tuple(range(gpus[rank])), env)

    return Launch(
        ref=WorkloadRef.job(4),
        command=SHOW,
        env={"TOKEN": "it's $secret"},
        cwd=tmp_path / "area" / "run",
        log_path=tmp_path / "logs" / "job-4.log",
        parts=(part(0, "b-node"), part(1, "a-node")),  # rank 0 is the placement's first
        identity=Identity(UID, UID),
        writable=(tmp_path / "area",),
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to a tenant's uid needs root")
def test_each_node_runs_the_command_in_its_sandbox_with_its_own_rank(tmp_path) -> None:
    lc = two_node_launch(tmp_path)
    (tmp_path / "area").mkdir()
    os.chown(tmp_path / "area", UID, UID)
    lc.log_path.parent.mkdir()
    write_spec_file(spec_file(lc), scope_for(tmp_path), *sandbox_spec(lc))
    script = task_script(lc)
    try:
        for node, rank, gpus in (("a-node", 1, "0,1"), ("b-node", 0, "2,3")):
            # as Slurm starts a task: its node's name, the GPUs it allocated there
            env = {"PATH": "/usr/bin:/bin", "SLURMD_NODENAME": node, "CUDA_VISIBLE_DEVICES": gpus}
            out = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True)
            assert (out.returncode, out.stdout, out.stderr) == (0, b"", b"")
            assert lc.log_path.read_text().splitlines()[-1] == (
                f"rank={rank} of 2 uid={UID} gpus={gpus} token=it's $secret {lc.cwd}"
            )
    finally:
        Sandbox(scope_for(tmp_path)).close()
    stranger = {"PATH": "/usr/bin:/bin", "SLURMD_NODENAME": "c-node"}
    out = subprocess.run(["/bin/sh", "-c", script], env=stranger, capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stderr == "gpucloud: node c-node is not in this placement\n"


def test_the_job_asks_slurm_for_the_placement_and_keeps_secrets_off_the_command_line(
    tmp_path,
) -> None:
    lc = two_node_launch(tmp_path)
    args = sbatch_args(lc)
    assert "--nodes=2" in args and "--nodelist=b-node,a-node" in args
    assert "--gres=gpu:2" in args and "--requeue" in args and "--export=NONE" in args
    assert not any("secret" in a for a in args)
    assert not any(a.startswith("--time") for a in args)  # no limit: the partition's


def test_slurms_time_limit_sends_its_term_no_earlier_than_the_jobs_own(tmp_path) -> None:
    """The control plane stops a run at its limit; Slurm's --time (whole minutes, TERM a
    minute before its end) is the backstop when the control plane is away."""
    for limit, minutes in ((1, 2), (60, 2), (90, 3), (7200, 121)):
        lc = dataclasses.replace(two_node_launch(tmp_path), time_limit=float(limit))
        (time_arg,) = [a for a in sbatch_args(lc) if a.startswith("--time=")]
        assert time_arg == f"--time={minutes}"
        assert minutes * 60 - SIGNAL_BEFORE_LIMIT >= limit
    script = batch_script(lc)
    assert "secret" not in script  # it is in the sandbox spec (0600) only
    assert "srun --export=ALL --nodes=2 --ntasks=2 --ntasks-per-node=1" in script
    spec, inherit = sandbox_spec(lc)
    assert spec.env == {"TOKEN": "it's $secret"}  # the device env is Slurm's: inherited
    assert {"GPUCLOUD_NODE_RANK", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID"} <= set(inherit)


def test_a_run_without_a_limit_gets_the_planners_estimate_with_a_margin(tmp_path) -> None:
    """Twice the planner's time for the steps, ten minutes to start, TERM's minute, rounded
    up to whole minutes, at most a week; a limit of the job's own wins."""
    lc = dataclasses.replace(two_node_launch(tmp_path), planned_seconds=3000.0)
    assert "--time=111" in sbatch_args(lc)  # (2 × 3000 + 600 + 60) / 60
    assert time_minutes(dataclasses.replace(lc, planned_seconds=0.001)) == 12
    assert time_minutes(dataclasses.replace(lc, planned_seconds=1e9)) == PLANNED_CAP // 60
    assert time_minutes(dataclasses.replace(lc, time_limit=60.0)) == 2


def test_a_placement_with_unequal_gpus_per_node_is_refused(tmp_path) -> None:
    with pytest.raises(StartError, match=r"same GPU count; the placement has \[1, 2\]"):
        sbatch_args(two_node_launch(tmp_path, gpus=(2, 1)))


def test_the_planner_times_a_training_jobs_steps_when_it_can_read_its_config(tmp_path) -> None:
    run = tmp_path / "run.toml"
    run.write_text(
        '[model]\npreset = "tiny"\n[data]\npath = "d"\n[optim]\nglobal_batch = 4\nmax_steps = 10\n'
    )
    planned = planned_seconds(str(run), None, "A100-80GB", 2, 1)
    assert planned is not None and 0 < planned < 1  # a tiny model at an A100's speed
    for train_config in (str(tmp_path / "gone.toml"), None):  # unreadable; a command job
        assert planned_seconds(train_config, None, "A100-80GB", 2, 1) is None
