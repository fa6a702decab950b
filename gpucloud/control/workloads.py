"""What the executor runs for a job or a replica: command, environment, dir and log file,
and the sandbox of its tenant: the user it runs as, the dirs it may use, its limits."""

from __future__ import annotations

import shlex
import socket
import sys
from dataclasses import replace
from pathlib import Path

from gpucloud.control import tenancy
from gpucloud.control.config import Settings
from gpucloud.control.executors.local import Launch
from gpucloud.control.models import Deployment, Job, Node, Replica, Tenant
from gpucloud.control.sandbox import Limits
from gpucloud.control.services import capacity
from gpucloud.hal.device import visible_devices_env


def gpucloud_command() -> str:
    """How a child process runs the `gpucloud` CLI of this very installation."""
    script = Path(sys.executable).parent / "gpucloud"
    if script.exists():
        return shlex.quote(str(script))
    return f"{shlex.quote(sys.executable)} -c 'from gpucloud.cli.main import app; app()'"


def job_launch(
    settings: Settings, job: Job, tenant: Tenant, node: Node, devices: list[int]
) -> Launch:
    own = tenancy.area(settings, tenant.name)
    readable: tuple[Path, ...] = ()
    if job.train_config is not None:
        # The run dir holds the checkpoints: a restarted attempt resumes from the newest.
        run_dir = job.checkpoint_dir or str(own / "runs" / f"job-{job.id}")
        command = (
            f"{gpucloud_command()} train run {shlex.quote(job.train_config)} "
            f"--nproc-per-node {job.gpus} --run-dir {shlex.quote(run_dir)}"
        )
        readable = (Path(job.train_config),)
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
    cwd = Path(job.workdir) if job.workdir else own / "work" / f"job-{job.id}"
    return _sandboxed(
        settings,
        tenant,
        Launch(command, env, cwd, settings.job_log(job.id), made),
        readable,
        Limits(capacity.cpus(job.cpu_milli) or None, job.memory_mib * 2**20 or None),
    )


def replica_launch(
    settings: Settings,
    dep: Deployment,
    tenant: Tenant,
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
    cwd = tenancy.area(settings, tenant.name) / "work" / f"deployment-{dep.id}"
    return _sandboxed(
        settings,
        tenant,
        Launch(command, env, cwd, settings.replica_log(replica.id)),
        (Path(dep.model_dir),),
        Limits(capacity.cpus(dep.cpu_milli) or None, dep.memory_mib * 2**20 or None),
    )


def _sandboxed(
    settings: Settings, tenant: Tenant, launch: Launch, readable: tuple[Path, ...], limits: Limits
) -> Launch:
    """`launch` in its tenant's sandbox: as the tenant's user, the control plane's home
    hidden but the tenant's area and the exports writable, and of the paths the tenant
    named (a model dir, a train config) only those its user could read anyway."""
    who = tenancy.identity(settings, tenant.id)
    tenancy.prepare_area(settings, tenant.name, who)
    return replace(
        launch,
        identity=who,
        writable=tenancy.writable_dirs(settings, tenant.name),
        readable=tuple(p for p in readable if p.is_absolute() and tenancy.reachable(p, who)),
        hidden=(settings.home,),
        limits=limits,
    )


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
