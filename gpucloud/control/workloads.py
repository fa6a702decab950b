"""What the executor runs for a job or a replica: command, environment, dir and log file,
and the sandbox of its tenant: the user it runs as, the dirs it may use, its limits."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from gpucloud import storage
from gpucloud.control import tenancy
from gpucloud.control.config import Settings
from gpucloud.control.executors.base import Launch, NodePart, WorkloadRef
from gpucloud.control.models import Deployment, DeploymentVersion, Job, Node, Replica, Tenant
from gpucloud.control.sandbox import Limits
from gpucloud.control.services import capacity
from gpucloud.errors import UserError
from gpucloud.hal.device import shared_device_env, visible_devices_env
from gpucloud.scheduler.state import MILLI


def gpucloud_command() -> str:
    """How a child process runs the `gpucloud` CLI of this very installation."""
    script = Path(sys.executable).parent / "gpucloud"
    if script.exists():
        return shlex.quote(str(script))
    return f"{shlex.quote(sys.executable)} -c 'from gpucloud.cli.main import app; app()'"


Placement = list[tuple[Node, list[int]]]  # each node of a workload with its devices there


def job_run_dir(settings: Settings, job: Job, tenant_name: str) -> Path | None:
    """Where the job's run writes its checkpoints and metrics.jsonl: a training job's
    checkpoint_dir, or its own dir in the tenant's area; a command job's checkpoint_dir
    ($GPUCLOUD_CHECKPOINT_DIR) if it has one, else None. A checkpoint_dir on object storage
    (a URL) holds only the checkpoints: the run's own files stay in its dir in the area."""
    if job.checkpoint_dir and not storage.is_url(job.checkpoint_dir):
        return Path(job.checkpoint_dir)
    if job.train_config is not None:
        return tenancy.area(settings, tenant_name) / "runs" / f"job-{job.id}"
    return None


def train_command(job: Job, run_dir: Path, nproc_per_node: int, nnodes: int) -> str:
    """`gpucloud train run` of the job's config. The run dir holds the checkpoints (unless
    they go to object storage): a restarted attempt resumes from the newest. On several
    nodes, torchrun meets its peers at the first node (c10d rendezvous)."""
    assert job.train_config is not None
    command = (
        f"{gpucloud_command()} train run {shlex.quote(job.train_config)} "
        f"--nproc-per-node {nproc_per_node} --run-dir {shlex.quote(str(run_dir))}"
    )
    if job.checkpoint_dir and storage.is_url(job.checkpoint_dir):
        command += f" --set {shlex.quote(f'checkpoint.dir={job.checkpoint_dir}')}"
    if job.model_dir:  # a registered model to start from; a TOML string, whatever it holds
        command += f" --set {shlex.quote(f'model.path={json.dumps(job.model_dir)}')}"
    if nnodes > 1:
        command += (
            f" --nnodes {nnodes} --rdzv $GPUCLOUD_MASTER_ADDR:$GPUCLOUD_MASTER_PORT"
            f" --rdzv-id job-{job.id}-{job.attempts} --local-addr $GPUCLOUD_NODE_ADDR"
        )
    return command


def job_launch(settings: Settings, job: Job, tenant: Tenant, placement: Placement) -> Launch:
    own = tenancy.area(settings, tenant.name)
    readable: tuple[Path, ...] = ()
    node, devices = placement[0]
    if job.train_config is not None:
        run_dir = job_run_dir(settings, job, tenant.name)
        command = train_command(job, run_dir, len(devices), len(placement))
        readable = (Path(job.train_config),)
        if job.model_dir and not storage.is_url(job.model_dir):
            readable += (Path(job.model_dir),)
    else:
        assert job.command is not None
        command = job.command
    procs = len(devices) if job.train_config is not None else 1
    nodes = device_nodes(node.backend, devices)
    env = {
        **_host_env(job.cpu_milli, job.memory_mib, procs),
        **job.env,
        "GPUCLOUD_JOB_ID": str(job.id),
        "GPUCLOUD_ATTEMPT": str(job.attempts),
    }
    if job.gpu_milli < MILLI:  # a share of one GPU that other jobs use too
        env |= shared_device_env(job.gpu_milli / MILLI, node.backend)
    made: tuple[Path, ...] = ()
    if job.checkpoint_dir:
        env["GPUCLOUD_CHECKPOINT_DIR"] = job.checkpoint_dir
        if not storage.is_url(job.checkpoint_dir):  # it may write there from its first step
            made = (Path(job.checkpoint_dir),)
    cwd = Path(job.workdir) if job.workdir else own / "work" / f"job-{job.id}"
    network = tenant.network != "isolated"
    ref = WorkloadRef.job(job.id)
    parts = _parts(placement, rendezvous_port(job.id, job.attempts))
    launch = Launch(
        ref,
        command,
        env,
        cwd,
        settings.log_path(ref),
        parts,
        make_dirs=made,
        network=network,
        time_limit=job.time_limit,
    )
    return _sandboxed(settings, tenant, launch, job, nodes, readable)


def _parts(placement: Placement, master_port: int) -> tuple[NodePart, ...]:
    """Each node's share, with its device env and, on several nodes, its rank, its own
    address and the rendezvous address (the first node's)."""
    master = placement[0][0].address
    parts = []
    for rank, (node, devices) in enumerate(placement):
        env = _device_env(node, devices, device_nodes(node.backend, devices))
        if len(placement) > 1:
            env |= {
                "GPUCLOUD_NNODES": str(len(placement)),
                "GPUCLOUD_NODE_RANK": str(rank),
                "GPUCLOUD_NODE_ADDR": node.address,
                "GPUCLOUD_MASTER_ADDR": master,
                "GPUCLOUD_MASTER_PORT": str(master_port),
            }
        parts.append(NodePart(node.name, node.address, tuple(devices), env))
    return tuple(parts)


def rendezvous_port(job_id: int, attempt: int) -> int:
    """The first node's port for a multi-node job's rendezvous: no process on the control
    plane can see which ports are free there, so each attempt of each job gets its own in
    20000-39999 (two jobs collide only when 20,000 attempts apart)."""
    return 20000 + (job_id * 97 + attempt) % 20000


def replica_url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address  # an IPv6 address
    return f"http://{host}:{port}"


def replica_launch(
    settings: Settings,
    dep: Deployment,
    version: DeploymentVersion,
    tenant: Tenant,
    replica: Replica,
    placement: Placement,
    port: int,
) -> Launch:
    """The launch of replica `replica`, serving `version` of `dep`."""
    node, devices = placement[0]
    if version.command:
        command = version.command.replace("{port}", str(port)).replace(
            "{model_dir}", shlex.quote(version.model_dir)
        )
    else:
        command = " ".join(
            [
                gpucloud_command(),
                "serve",
                shlex.quote(version.model_dir),
                f"--host {shlex.quote(node.address)}",
                f"--port {port}",
                f"--served-model-name {shlex.quote(dep.name)}",  # what the gateway routes by
                *map(shlex.quote, version.engine_args),
            ]
        )
    nodes = device_nodes(node.backend, devices)
    env = {
        **_host_env(dep.cpu_milli, dep.memory_mib, 1),
        **dep.env,
        "GPUCLOUD_DEPLOYMENT": dep.name,
        "GPUCLOUD_REPLICA": str(replica.index),
        "GPUCLOUD_DEPLOYMENT_VERSION": str(version.number),
    }
    cwd = tenancy.area(settings, tenant.name) / "work" / f"deployment-{dep.id}"
    ref = WorkloadRef.replica(replica.id)
    parts = _parts(placement, port)
    launch = Launch(ref, command, env, cwd, settings.log_path(ref), parts, port=port)
    if storage.is_url(version.model_dir):  # object storage: fetched by the replica, no bind
        return _sandboxed(settings, tenant, launch, dep, nodes, ())
    model_dir = Path(version.model_dir)
    needs_model = not version.command or "{model_dir}" in version.command
    return _sandboxed(
        settings, tenant, launch, dep, nodes, (model_dir,), model_dir if needs_model else None
    )


def _sandboxed(
    settings: Settings,
    tenant: Tenant,
    launch: Launch,
    workload: Job | Deployment,
    devices: list[Path],
    readable: tuple[Path, ...],
    model_dir: Path | None = None,
) -> Launch:
    """`launch` in its tenant's sandbox: as the tenant's user, its HOME the tenant's area,
    the control plane's home hidden but the tenant's area and the exports writable, of the
    paths the tenant named (a model dir, a train config) only those its user could read
    anyway, its GPUs' device nodes, and the control plane's compiled kernels read-only.
    Raises UserError if `model_dir` (which the workload must read) is none of those."""
    who = tenancy.identity(settings, tenant.id)
    own = tenancy.prepare_area(settings, tenant.name, who)
    env = {"HOME": str(own), **launch.env, **_kernel_env(settings)}
    writable = tenancy.writable_dirs(settings, tenant.name)
    shown = _readable(readable, writable, who)
    if model_dir is not None and not (_inside(model_dir, writable) or model_dir.resolve() in shown):
        raise UserError(
            f"the model dir {model_dir} cannot be read by tenant {tenant.name}'s workloads, "
            "which run as its own OS user: upload it (gpucloud deploy create --upload) or ask "
            "the admin to export its dir (gpucloud up --export DIR)"
        )
    if settings.kernel_dir.is_dir():
        shown.append(settings.kernel_dir)
    return replace(
        launch,
        env=env,
        identity=who,
        writable=writable,
        readable=tuple(shown),
        hidden=(settings.home,),
        devices=tuple(devices),
        limits=_limits(settings, workload),
    )


def _limits(settings: Settings, workload: Job | Deployment) -> Limits:
    """What its cgroup enforces: the CPUs and memory it asked for (per replica), and the
    control plane's pids limit."""
    return Limits(
        capacity.cpus(workload.cpu_milli) or None,
        workload.memory_mib * 2**20 or None,
        settings.workload_pids,
    )


def _inside(path: Path, dirs: tuple[Path, ...]) -> bool:
    return path.is_absolute() and any(path.is_relative_to(d) for d in dirs)


def _readable(paths, writable: tuple[Path, ...], who) -> list[Path]:
    """Of the absolute paths a tenant named, those to bind read-only: not those its
    writable dirs already show, and only as the real paths its user could read."""
    found = []
    for p in paths:
        if not p.is_absolute() or _inside(p, writable):
            continue
        real = p.resolve()
        if tenancy.reachable(real, who):
            found.append(real)
    return found


def _kernel_env(settings: Settings) -> dict[str, str]:
    return {"GPUCLOUD_KERNEL_DIR": str(settings.kernel_dir), "GPUCLOUD_KERNEL_BUILD": "0"}


def build_kernels(settings: Settings) -> subprocess.Popen | None:
    """Start building the CPU kernels replicas load (a minute, in the background, in this
    process group) when no build is there yet; None when there is one."""
    if any(settings.kernel_dir.glob("*/*.so")):
        return None
    settings.kernel_dir.mkdir(parents=True, exist_ok=True)
    with (settings.logs_dir / "kernel-build.log").open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "gpucloud.serve.cpu_kernels"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "GPUCLOUD_KERNEL_DIR": str(settings.kernel_dir)},
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The device nodes of each backend's accelerators: per device (by index), and shared ones.
_DEVICE_NODES = {
    "cuda": ("nvidia{}", ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")),
    "npu": ("davinci{}", ("davinci_manager", "devmm_svm", "hisi_hdc")),
}


def device_nodes(backend: str, devices: list[int], dev: Path = Path("/dev")) -> list[Path]:
    """The device nodes a workload given `devices` may open, of those that exist: its
    sandbox's /dev holds only these and the harmless ones (null, zero, random, tty...)."""
    per_device, shared = _DEVICE_NODES.get(backend, ("", ()))
    names = [*shared, *(per_device.format(i) for i in devices)] if per_device else []
    return [dev / n for n in names if (dev / n).exists()]


def _device_env(node: Node, devices: list[int], nodes: Sequence[Path] = ()) -> dict[str, str]:
    # With only its own GPUs' `nodes` in its /dev, CUDA numbers them from 0 (as under
    # Slurm's ConstrainDevices); GPUCLOUD_DEVICES keeps the node's numbers.
    visible = list(range(len(devices))) if node.backend == "cuda" and nodes else devices
    return {
        **visible_devices_env(visible, node.backend),
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
