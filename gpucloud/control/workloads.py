"""What the executor runs for a job or a replica: command, environment, dir and log file."""

from __future__ import annotations

import shlex
import socket
import sys
from pathlib import Path

from gpucloud.control.config import Settings
from gpucloud.control.executors.local import Launch
from gpucloud.control.models import Deployment, Job, Node, Replica
from gpucloud.control.services import capacity
from gpucloud.hal.device import visible_devices_env


def gpucloud_command() -> str:
    """How a child process runs the `gpucloud` CLI of this very installation."""
    script = Path(sys.executable).parent / "gpucloud"
    if script.exists():
        return shlex.quote(str(script))
    return f"{shlex.quote(sys.executable)} -c 'from gpucloud.cli.main import app; app()'"


def job_launch(settings: Settings, job: Job, node: Node, devices: list[int]) -> Launch:
    if job.train_config is not None:
        # The run dir holds the checkpoints: a restarted attempt resumes from the newest.
        run_dir = job.checkpoint_dir or str(settings.home / "runs" / f"job-{job.id}")
        command = (
            f"{gpucloud_command()} train run {shlex.quote(job.train_config)} "
            f"--nproc-per-node {job.gpus} --run-dir {shlex.quote(run_dir)}"
        )
    else:
        assert job.command is not None
        command = job.command
    procs = job.gpus if job.train_config is not None else 1
    env = {
        **_host_env(job.cpu_milli, job.memory_mib, procs),
        **job.env,
        **_device_env(node, devices),
        "GPUCLOUD_JOB_ID": str(job.id),
        "GPUCLOUD_ATTEMPT": str(job.attempts),
    }
    made: tuple[Path, ...] = ()
    if job.checkpoint_dir:
        env["GPUCLOUD_CHECKPOINT_DIR"] = job.checkpoint_dir
        made = (Path(job.checkpoint_dir),)  # the job may write into it from its first step
    cwd = Path(job.workdir) if job.workdir else settings.home / "work" / f"job-{job.id}"
    return Launch(command, env, cwd, settings.job_log(job.id), made)


def replica_launch(
    settings: Settings,
    dep: Deployment,
    replica: Replica,
    node: Node,
    devices: list[int],
    port: int,
) -> Launch:
    if dep.command:
        command = dep.command.replace("{port}", str(port)).replace(
            "{model_dir}", shlex.quote(dep.model_dir)
        )
    else:
        command = " ".join(
            [
                gpucloud_command(),
                "serve",
                shlex.quote(dep.model_dir),
                "--host 127.0.0.1",
                f"--port {port}",
                f"--served-model-name {shlex.quote(dep.name)}",  # what the gateway routes by
                *map(shlex.quote, dep.engine_args),
            ]
        )
    env = {
        **_host_env(dep.cpu_milli, dep.memory_mib, 1),
        **dep.env,
        **_device_env(node, devices),
        "GPUCLOUD_DEPLOYMENT": dep.name,
        "GPUCLOUD_REPLICA": str(replica.index),
    }
    cwd = settings.home / "work" / f"deployment-{dep.id}"
    return Launch(command, env, cwd, settings.replica_log(replica.id))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device_env(node: Node, devices: list[int]) -> dict[str, str]:
    return {
        **visible_devices_env(devices, node.backend),
        "GPUCLOUD_DEVICES": ",".join(map(str, devices)),
        "GPUCLOUD_NODE": node.name,
        "PYTHONUNBUFFERED": "1",  # logs appear as they are written
    }


def _host_env(cpu_milli: int, memory_mib: int, procs: int) -> dict[str, str]:
    """What the workload was granted, and as many math-library threads per process as
    that grant holds whole cores (the workload's own env may override them)."""
    env = {}
    if cpu_milli:
        env["GPUCLOUD_CPUS"] = f"{capacity.cpus(cpu_milli):g}"
        env["OMP_NUM_THREADS"] = str(max(1, cpu_milli // 1000 // procs))
    if memory_mib:
        env["GPUCLOUD_MEMORY_MIB"] = str(memory_mib)
    return env
