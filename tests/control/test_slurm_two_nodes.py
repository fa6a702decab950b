"""A gang on a real 2-node Slurm cluster: two slurmds on this machine, each a node with its
own GPUs (tests/control/slurm_cluster.py). The Slurm executor submits one job through
sbatch, whose srun starts a task per node; each task runs its rank in its tenant's sandbox
(one per node), and the two ranks meet over torch.distributed (gloo) at the first node."""

from __future__ import annotations

import json
import os
import sys

import pytest

from gpucloud.control.config import Settings
from gpucloud.control.executors.base import Exit, Launch, NodePart, WorkloadRef
from gpucloud.control.executors.slurm import SlurmExecutor
from gpucloud.control.sandbox import Identity, Sandbox, scope_for

from .conftest import free_port, wait_for
from .slurm_cluster import GPUS, running

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(os.geteuid() != 0, reason="Slurm's daemons and the sandbox need root"),
]
UID = 64531  # the tenant's

# Each rank adds its rank + 1 over gloo: both print the sum, 3.0, when they met.
GLOO = """
import os, torch, torch.distributed as dist
rank = int(os.environ["GPUCLOUD_NODE_RANK"])
address = f"tcp://{os.environ['GPUCLOUD_MASTER_ADDR']}:{os.environ['GPUCLOUD_MASTER_PORT']}"
dist.init_process_group("gloo", init_method=address, rank=rank,
                        world_size=int(os.environ["GPUCLOUD_NNODES"]))
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print(f"rank {rank} on {os.environ['SLURMD_NODENAME']} gpus {os.environ['CUDA_VISIBLE_DEVICES']}"
      f" sum {total.item()}", flush=True)
dist.destroy_process_group()
"""


def test_a_two_node_gang_runs_a_rank_on_each_node_over_gloo_and_both_finish(
    tmp_path, monkeypatch
) -> None:
    home, area = tmp_path / "home", tmp_path / "area"
    area.mkdir()
    os.chown(area, UID, UID)
    with running(nodes=2) as cluster:
        monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
        settings = Settings(home=home, gpu_type="A100-80GB")
        executor = SlurmExecutor(settings, inventory_ttl=0, queue_ttl=0)
        nodes = sorted(executor.inventory(), key=lambda n: n.name)
        assert [(n.name, n.gpus) for n in nodes] == [(name, GPUS) for name in cluster.nodes]

        port = free_port()
        ref = WorkloadRef.job(1)
        parts = tuple(
            NodePart(
                node.name,
                "127.0.0.1",
                (0, 1),
                {
                    "GPUCLOUD_NNODES": "2",
                    "GPUCLOUD_NODE_RANK": str(rank),
                    "GPUCLOUD_MASTER_ADDR": "127.0.0.1",
                    "GPUCLOUD_MASTER_PORT": str(port),
                },
            )  # fmt: skip
            for rank, node in enumerate(reversed(nodes))  # rank 0: the placement's first
        )
        script = area / "gloo.py"
        script.write_text(GLOO)
        launch = Launch(
            ref=ref,
            command=f"exec {sys.executable} {script}",
            env={},
            cwd=area / "run",
            log_path=settings.logs_dir / f"{ref}.log",
            parts=parts,
            identity=Identity(UID, UID),
            writable=(area,),
            hidden=(home,),
        )
        try:
            handle = executor.start(launch)
            ended = wait_for(lambda: executor.poll(handle), timeout=180, interval=0.2)
        finally:
            Sandbox(scope_for(home)).close()

        log = launch.log_path.read_text()
        assert ended == Exit(0), log
        first, second = (p.node for p in parts)
        lines = sorted(line for line in log.splitlines() if line.startswith("rank "))
        assert lines == [
            f"rank 0 on {first} gpus 0,1 sum 3.0",
            f"rank 1 on {second} gpus 0,1 sum 3.0",
        ], log
        (job,) = json.loads(cluster.run("squeue", "--json", "--states=all"))["jobs"]
        assert job["job_state"] == "COMPLETED" and job["node_count"] == 2, job
