"""The Slurm batch script of a 2-node placement, run by a real shell per node (the Slurm
test cluster has one node: a 2-node job cannot run there)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpucloud.control.executors.base import Launch, NodePart, StartError, WorkloadRef
from gpucloud.control.executors.slurm_batch import batch_script, sbatch_args, task_script

SHOW = (
    'echo "rank=$GPUCLOUD_NODE_RANK of $GPUCLOUD_NNODES"'
    ' "gpus=${CUDA_VISIBLE_DEVICES:-slurms} $PWD"'
)


def two_node_launch(tmp_path: Path, gpus=(2, 2)) -> Launch:
    def part(rank: int, node: str) -> NodePart:
        env = {"GPUCLOUD_NODE_RANK": str(rank), "GPUCLOUD_NNODES": "2", "CUDA_VISIBLE_DEVICES": "5"}
        return NodePart(node, f"10.0.0.{rank + 1}", tuple(range(gpus[rank])), env)

    return Launch(
        ref=WorkloadRef.job(4),
        command=SHOW,
        env={"TOKEN": "it's $secret"},
        cwd=tmp_path / "run",
        log_path=tmp_path / "job-4.log",
        parts=(part(0, "b-node"), part(1, "a-node")),  # rank 0 is the placement's first
    )


def test_each_node_runs_the_command_with_its_own_rank(tmp_path) -> None:
    lc = two_node_launch(tmp_path)
    script = task_script(lc)
    for node, rank in (("a-node", 1), ("b-node", 0)):
        env = {"PATH": "/usr/bin:/bin", "SLURMD_NODENAME": node}
        out = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True)
        assert out.stdout == f"rank={rank} of 2 gpus=slurms {lc.cwd}\n"
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
    script = batch_script(lc)
    assert "export TOKEN='it'\"'\"'s $secret'\n" in script
    assert "srun --export=ALL --nodes=2 --ntasks=2 --ntasks-per-node=1" in script


def test_a_placement_with_unequal_gpus_per_node_is_refused(tmp_path) -> None:
    with pytest.raises(StartError, match=r"same GPU count; the placement has \[1, 2\]"):
        sbatch_args(two_node_launch(tmp_path, gpus=(2, 1)))
