"""The Slurm executor against a real one-node Slurm cluster (tests/control/slurm_cluster.py):
inventory, 2-GPU jobs, exits, stop, a requeue by Slurm seen as a lost attempt, and the
sandbox every job runs in (its tenant's uid, the control plane's home hidden, its cgroup's
memory limit)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpucloud.control.config import Settings
from gpucloud.control.executors.base import Exit, Handle, Launch, NodePart, WorkloadRef
from gpucloud.control.executors.slurm import SlurmExecutor
from gpucloud.control.sandbox import Identity, Limits, Sandbox, scope_for

from .conftest import wait_for
from .slurm_cluster import CPUS, GPUS, MEMORY_MIB, SlurmCluster, running

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(os.geteuid() != 0, reason="Slurm's daemons and the sandbox need root"),
]
UID = 64521  # the tenant's

# Waits on a flag file the test creates, so a job runs exactly as long as a test needs.
HOLD = 'echo ready; while [ ! -e "$GO" ]; do sleep 0.1; done'


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with running() as c:
        yield c


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> Iterator[Settings]:
    """The control plane's: its home holds a secret its workloads must not read."""
    home = tmp_path_factory.mktemp("home")
    (home / "state.db").write_text("admin secret")
    yield Settings(home=home, gpu_type="A100-80GB")
    Sandbox(scope_for(home)).close()


@pytest.fixture
def executor(cluster: SlurmCluster, settings, monkeypatch) -> SlurmExecutor:
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    return SlurmExecutor(settings, inventory_ttl=0, queue_ttl=0, unreachable_backoff=1)


_ids = iter(range(1, 10_000))


@pytest.fixture
def job(cluster, settings, tmp_path):
    """Makes a job's Launch: of the tenant UID, whose area is `tmp_path`."""
    os.chown(tmp_path, UID, UID)

    def make(command: str, gpus: int = 2, limits: Limits = Limits(), **env: str) -> Launch:  # noqa: B008
        ref = WorkloadRef.job(next(_ids))
        part = NodePart(
            cluster.node,
            "127.0.0.1",
            tuple(range(gpus)),
            # the device env our scheduler would set: Slurm's allocation must replace it
            {"GPUCLOUD_NODE_RANK": "0", "GPUCLOUD_NNODES": "1", "CUDA_VISIBLE_DEVICES": "7,8"},
        )
        return Launch(
            ref=ref,
            command=command,
            env={"GO": str(tmp_path / f"{ref}.go"), **env},
            cwd=tmp_path / "runs" / str(ref),
            log_path=settings.logs_dir / f"{ref}.log",
            parts=(part,),
            identity=Identity(UID, UID),
            writable=(tmp_path,),
            hidden=(settings.home,),
            limits=limits,
        )

    return make


def log_of(lc: Launch) -> str:
    return lc.log_path.read_text() if lc.log_path.exists() else ""


def slurm_state(cluster: SlurmCluster, handle: Handle) -> str:
    jobs = json.loads(cluster.run("squeue", "--json", "--states=all"))["jobs"]
    return next(j["job_state"] for j in jobs if str(j["job_id"]) == handle.token)


def wait_exit(executor: SlurmExecutor, handle: Handle, timeout: float = 60):
    return wait_for(lambda: executor.poll(handle), timeout=timeout, interval=0.2)


def test_inventory_reports_the_node_and_its_four_gpus(cluster, executor) -> None:
    [node] = executor.inventory()
    assert node.name == cluster.node
    assert (node.gpus, node.gpu_type, node.backend) == (GPUS, "A100-80GB", "cuda")
    assert (node.cpu_milli, node.memory_mib) == (CPUS * 1000, MEMORY_MIB)
    assert node.address == "127.0.0.1"
    assert node.healthy and node.reason is None
    assert node.labels == {"slurm-partitions": "gpu"}


def test_a_drained_node_is_unhealthy_with_slurms_reason(cluster, executor) -> None:
    cluster.run("scontrol", "update", f"nodename={cluster.node}", "state=drain", "reason=bad fan")
    try:
        [node] = executor.inventory()
        assert not node.healthy
        assert node.reason == "IDLE DRAIN: bad fan"
    finally:
        cluster.run("scontrol", "update", f"nodename={cluster.node}", "state=resume")
    wait_for(lambda: executor.inventory()[0].healthy)


def test_two_2_gpu_jobs_run_at_once_on_the_gpus_slurm_gave_them(
    cluster, executor, job, monkeypatch
) -> None:
    monkeypatch.setenv("CONTROL_PLANE_ONLY", "must not reach a job")
    show = (
        "echo gpus=$CUDA_VISIBLE_DEVICES rank=$GPUCLOUD_NODE_RANK secret=$SECRET"
        " leaked=${CONTROL_PLANE_ONLY:-no} cwd=$(pwd); " + HOLD
    )
    launches = [job(show, SECRET="s3 cr'et") for _ in range(2)]
    handles = [executor.start(lc) for lc in launches]
    assert [h.ref for h in handles] == [lc.ref for lc in launches]
    assert all(h.token.isdigit() for h in handles)
    # both run at once: each prints "ready", then waits for its flag
    wait_for(lambda: all("ready" in log_of(lc) for lc in launches), timeout=60)
    assert [executor.poll(h) for h in handles] == [None, None]
    for lc in launches:
        Path(lc.env["GO"]).touch()
    exits = [wait_exit(executor, h) for h in handles]
    assert [(e.code, e.lost) for e in exits] == [(0, False), (0, False)]
    lines = [log_of(lc).splitlines()[0] for lc in launches]
    assert sorted(lines) == [
        f"gpus=0,1 rank=0 secret=s3 cr'et leaked=no cwd={launches[0].cwd}",
        f"gpus=2,3 rank=0 secret=s3 cr'et leaked=no cwd={launches[1].cwd}",
    ] or sorted(lines) == [
        f"gpus=0,1 rank=0 secret=s3 cr'et leaked=no cwd={launches[1].cwd}",
        f"gpus=2,3 rank=0 secret=s3 cr'et leaked=no cwd={launches[0].cwd}",
    ]
    assert oct(launches[0].log_path.stat().st_mode & 0o777) == "0o600"


def test_a_job_runs_as_its_tenant_and_cannot_read_the_control_planes_home(
    executor, job, settings
) -> None:
    home = settings.home
    lc = job(f"echo uid=$(id -u) home=$(ls -A {home} | wc -l); cat {home}/state.db", gpus=1)
    exit_ = wait_exit(executor, executor.start(lc))
    assert exit_.code == 1  # cat found nothing to read
    assert log_of(lc).splitlines()[0] == f"uid={UID} home=0"
    assert "admin secret" not in log_of(lc)


def test_a_job_beyond_its_memory_limit_is_killed_by_its_cgroup(executor, job) -> None:
    lc = job("python -c \"b = b'x' * (256 << 20)\"", gpus=1, limits=Limits(memory_bytes=64 << 20))
    exit_ = wait_exit(executor, executor.start(lc))
    assert exit_.code == 137  # SIGKILL, by the kernel's OOM killer
    assert "gpucloud sandbox: out of memory: limit 64 MiB\n" in log_of(lc), log_of(lc)


def test_a_job_whose_sandbox_cannot_be_set_up_says_why(executor, job) -> None:
    lc = dataclasses.replace(job("echo never", gpus=1), cwd=Path("/proc/no/such/dir"))
    exit_ = wait_exit(executor, executor.start(lc))
    assert exit_.code is None and not exit_.lost  # a failed attempt, as on the local executor
    assert exit_.reason.startswith("could not start: gpucloud sandbox:"), exit_.reason


def test_an_exit_code_comes_back_and_a_restarted_control_plane_reads_it(
    cluster, executor, job, settings
) -> None:
    lc = job("echo failing; exit 3", gpus=1)
    handle = executor.start(lc)
    assert wait_exit(executor, handle).code == 3
    adopted = SlurmExecutor(settings)  # a new control plane's
    exit_ = adopted.poll(Handle(handle.ref, handle.token))
    assert (exit_.code, exit_.lost) == (3, False)
    assert "failing" in log_of(lc)


def test_a_job_slurm_has_forgotten_is_read_from_the_job_completion_log(cluster, executor) -> None:
    # slurmctld forgets ended jobs after MinJobAge; their jobcomp/filetxt record stays
    record = "JobId=999999999 UserId=root(0) JobState=FAILED NodeList=n1 ExitCode=0:9\n"
    with cluster.jobcomp.open("a") as f:
        f.write(record)
    exit_ = executor.poll(Handle(WorkloadRef.job(9), "999999999"))
    assert (exit_.code, exit_.lost) == (128 + 9, False)
    gone = executor.poll(Handle(WorkloadRef.job(9), "999999998"))
    assert (gone.code, gone.lost) == (None, True)
    assert gone.reason == "Slurm no longer knows job 999999998"


def test_stop_sends_sigterm_and_the_job_ends_within_its_grace(cluster, executor, job) -> None:
    lc = job("trap 'echo got TERM; exit 7' TERM; " + HOLD)
    handle = executor.start(lc)
    wait_for(lambda: "ready" in log_of(lc), timeout=60)
    exit_ = executor.stop(handle, grace=60)
    assert (exit_.code, exit_.lost) == (7, False)  # its own exit, not a kill
    assert "got TERM" in log_of(lc)
    assert slurm_state(cluster, handle) == "FAILED"


def test_stop_kills_a_job_that_ignores_sigterm_after_grace(cluster, executor, job) -> None:
    lc = job("trap 'echo ignoring TERM' TERM; " + HOLD)
    handle = executor.start(lc)
    wait_for(lambda: "ready" in log_of(lc), timeout=60)
    exit_ = executor.stop(handle, grace=1)
    assert "ignoring TERM" in log_of(lc)
    assert exit_ == Exit(None, "cancelled in Slurm")
    assert slurm_state(cluster, handle) == "CANCELLED"


def test_stop_of_a_queued_job_cancels_it(cluster, executor, job) -> None:
    big = job(HOLD, gpus=GPUS)
    first = executor.start(big)
    waiting = executor.start(job("echo never", gpus=1))
    wait_for(lambda: "ready" in log_of(big), timeout=60)
    assert executor.poll(waiting) is None  # queued behind the first: no free GPU
    exit_ = executor.stop(waiting, grace=5)
    assert exit_.reason == "cancelled in Slurm" and not exit_.lost
    assert slurm_state(cluster, waiting) == "CANCELLED"
    Path(big.env["GO"]).touch()
    assert wait_exit(executor, first).code == 0


def test_a_job_slurm_requeues_is_lost_and_not_rerun_by_slurm(cluster, executor, job) -> None:
    lc = job("echo restart=$SLURM_RESTART_COUNT; " + HOLD)
    handle = executor.start(lc)
    wait_for(lambda: "ready" in log_of(lc), timeout=60)
    cluster.run("scontrol", "requeue", handle.token)  # as a preemption or node failure does
    exit_ = wait_exit(executor, handle)
    assert exit_.lost and exit_.code is None
    assert exit_.reason == "requeued by Slurm (restart 1)"
    assert slurm_state(cluster, handle) == "CANCELLED"
    assert "restart=1" not in log_of(lc)  # Slurm did not run its own copy


def test_while_slurmctld_is_away_nothing_changes(cluster, executor, job) -> None:
    lc = job(HOLD, gpus=1)
    handle = executor.start(lc)
    wait_for(lambda: "ready" in log_of(lc), timeout=60)
    nodes = executor.inventory()
    cluster.stop_daemon("slurmctld")
    try:
        assert executor.poll(handle) is None  # still running, as far as anyone knows
        assert executor.inventory() == nodes  # not a cluster that lost every node
        Path(lc.env["GO"]).touch()  # it ends while slurmctld is away
    finally:
        cluster.start_daemon("slurmctld")
    exit_ = wait_exit(executor, handle, timeout=120)
    assert (exit_.code, exit_.lost) == (0, False)
