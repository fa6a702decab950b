"""A real `gpucloud server --executor slurm` on a one-node Slurm cluster, driven by the CLI:
2-GPU jobs run as Slurm jobs, a job beyond the free GPUs waits in our queue (not in
Slurm's), `gpucloud job cancel` scancels, and a job Slurm requeues (a preemption) is
requeued by the control plane without using a retry and resumes from its checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpucloud.control.errors import ConflictError
from gpucloud.control.lifecycle import FINISHED

from .conftest import GPUCLOUD, Server, wait_for, wait_state
from .slurm_cluster import SlurmCluster, running

pytestmark = pytest.mark.slurm

# Holds until the test creates `done` in its checkpoint dir; says so when it gets SIGTERM.
HOLD = 'while [ ! -e "$GPUCLOUD_CHECKPOINT_DIR/done" ]; do sleep 0.1; done'


STUBBORN = (
    "terms=0; trap 'terms=$((terms + 1)); echo got TERM $terms; [ $terms -lt 2 ] || exit' TERM; "
)


TENANT_UID = 62002


class SlurmServer(Server):
    """A server whose Slurm commands reach the test cluster."""

    def __init__(self, cluster: SlurmCluster, home: Path) -> None:
        extra = ("--executor", "slurm", "--node-timeout", "60")
        super().__init__(f"sqlite:///{home / 'state.db'}", home, extra=extra)
        self.cluster = cluster

    @property
    def env(self) -> dict[str, str]:
        return {**super().env, "SLURM_CONF": str(self.cluster.conf)}


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with running() as c:
        yield c


@pytest.fixture(scope="module")
def server(cluster, tmp_path_factory) -> Iterator[SlurmServer]:
    srv = SlurmServer(cluster, tmp_path_factory.mktemp("home")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def team(server) -> str:
    """A tenant's API key."""
    created = server.client().post("/tenants", {"name": "slurm-team"})
    assert created["id"] == TENANT_UID - 62000  # the first tenant after the admin's
    return created["api_key"]


@pytest.fixture(autouse=True)
def no_job_left_running(server, team) -> Iterator[None]:
    """After each test, its jobs end: a test that failed half-way must not leave the next
    ones waiting for GPUs its jobs still hold (the last test stops the server itself)."""
    yield
    if server.proc.poll() is not None:
        return
    client = server.client(team)
    left = [j for j in client.get("/jobs") if j["state"] not in FINISHED]
    for job in left:
        with contextlib.suppress(ConflictError):  # it ended meanwhile
            client.post(f"/jobs/{job['id']}/cancel")
    for job in left:
        wait_state(client, job["id"], *FINISHED, timeout=120)


def cli(server: Server, key: str, *args: str) -> str:
    env = {**server.env, "GPUCLOUD_API_KEY": key}
    out = subprocess.run(
        [GPUCLOUD, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def submit(server: Server, key: str, tmp: Path, name: str, command: str) -> dict:
    spec = tmp / f"{name}.yaml"
    spec.write_text(
        json.dumps({"name": name, "command": command, "gpus": 2, "checkpoint_dir": name})
    )
    return json.loads(cli(server, key, "job", "submit", str(spec), "--no-upload", "--json"))


def slurm_jobs(cluster: SlurmCluster, job_id: int) -> list[dict]:
    """Every Slurm job the control plane made for our job `job_id`, oldest first."""
    jobs = json.loads(cluster.run("squeue", "--json", "--states=all"))["jobs"]
    return [j for j in jobs if j["name"] == f"gpucloud-job-{job_id}"]


def logs_once(server: Server, key: str, job: dict, text: str) -> str:
    """The job's logs, once they hold `text`."""
    job_id = str(job["id"])
    return wait_for(lambda: text in (out := cli(server, key, "job", "logs", job_id)) and out)


def done(job: dict) -> None:
    """Let a HOLD job end (it made its checkpoint dir: its log says it started)."""
    Path(job["checkpoint_dir"], "done").touch()


def test_jobs_run_as_slurm_jobs_wait_in_our_queue_and_cancel_by_scancel(
    cluster, server, team, tmp_path
) -> None:
    show = "echo gpus=$CUDA_VISIBLE_DEVICES slurm_job=$SLURM_JOB_ID uid=$(id -u); "
    # ignores the first SIGTERM (a stop's, before its grace), ends at the second (scancel's)
    stubborn = submit(server, team, tmp_path, "stubborn", show + STUBBORN + HOLD)
    polite = submit(server, team, tmp_path, "polite", show + HOLD)
    client = server.client(team)
    for job in (stubborn, polite):
        wait_state(client, job["id"], "RUNNING", timeout=60)
    # both 2-GPU jobs run under Slurm, on GPUs of their own
    logs = {job["id"]: logs_once(server, team, job, "gpus=") for job in (stubborn, polite)}
    for job in (stubborn, polite):
        [slurm] = slurm_jobs(cluster, job["id"])
        assert (slurm["job_state"], slurm["tres_per_node"]) == ("RUNNING", "gres:gpu:2")
        # in its tenant's sandbox: as the tenant's own user (--tenant-uids 62000-62999)
        first = logs[job["id"]].splitlines()[0]
        assert first.split()[1:] == [f"slurm_job={slurm['job_id']}", f"uid={TENANT_UID}"]
    gpus = sorted(log.split()[0] for log in logs.values())
    assert gpus == ["gpus=0,1", "gpus=2,3"]

    # a third waits in our queue, with a reason; Slurm never hears of it
    third = submit(server, team, tmp_path, "third", show + HOLD)
    # the reason comes with the first scheduling pass after the submission
    waiting = wait_for(lambda: (j := client.get(f"/jobs/{third['id']}"))["reason"] and j)
    assert waiting["state"] == "PENDING"
    assert "GPU" in waiting["reason"]
    assert slurm_jobs(cluster, third["id"]) == []

    # cancel: SIGTERM, ignored; after the grace, scancel
    assert cli(server, team, "job", "cancel", str(stubborn["id"])) == (
        f"job {stubborn['id']}: cancelling\n"
    )
    cancelled = wait_state(client, stubborn["id"], "CANCELLED", timeout=60)
    assert cancelled["reason"]
    [stubborn_slurm] = slurm_jobs(cluster, stubborn["id"])
    assert stubborn_slurm["job_state"] == "CANCELLED"
    logs = cli(server, team, "job", "logs", str(stubborn["id"]))
    assert [line for line in logs.splitlines() if "got TERM" in line] == [
        "got TERM 1",  # the stop's, ignored
        "got TERM 2",  # scancel's
    ]

    # its GPUs free, the third starts (in Slurm once its node has cleaned up after the
    # cancelled job: under load that may be a moment after our scheduler placed it)
    wait_state(client, third["id"], "RUNNING", timeout=60)
    wait_for(lambda: [j["job_state"] for j in slurm_jobs(cluster, third["id"])] == ["RUNNING"],
             timeout=60)  # fmt: skip
    logs_once(server, team, third, "gpus=")
    for job in (polite, third):
        done(job)
    for job in (polite, third):
        assert wait_state(client, job["id"], "SUCCEEDED", timeout=60)["attempts"] == 1


# Counts on from the step its checkpoint holds, one step a poll, until told to finish.
RESUMABLE = (
    'ckpt="$GPUCLOUD_CHECKPOINT_DIR"; step=$(cat "$ckpt/step" 2>/dev/null || echo 0); '
    'echo "attempt $GPUCLOUD_ATTEMPT starts at step $step"; '
    'while [ ! -e "$ckpt/done" ]; do step=$((step + 1)); echo $step > "$ckpt/step.tmp"; '
    'mv "$ckpt/step.tmp" "$ckpt/step"; sleep 0.1; done; echo "finished at step $step"'
)


def test_a_training_job_without_a_time_limit_gets_slurms_from_the_planner(
    cluster, server, team, tmp_path
) -> None:
    """Slurm's --time of a training job with no limit of its own is the planner's time for
    its steps with a margin: the tiny model's 10 steps take no time at an A100's speed, so
    it is the start's 10 minutes and TERM's minute, rounded up to 12 minutes."""
    run = tmp_path / "run.toml"
    run.write_text(
        '[model]\npreset = "tiny"\n[data]\npath = "data"\n'
        "[optim]\nglobal_batch = 4\nmax_steps = 10\n"
    )
    spec = tmp_path / "train.yaml"
    spec.write_text(json.dumps({"name": "planned", "train": str(run), "gpus": 2}))
    job = json.loads(cli(server, team, "job", "submit", str(spec), "--no-upload", "--json"))
    [slurm] = wait_for(lambda: slurm_jobs(cluster, job["id"]))
    assert slurm["time_limit"] == 12, slurm
    cli(server, team, "job", "cancel", str(job["id"]))
    wait_state(server.client(team), job["id"], "CANCELLED", "FAILED", timeout=60)


def test_a_job_slurm_requeues_resumes_from_its_checkpoint_without_using_a_retry(
    cluster, server, team, tmp_path
) -> None:
    job = submit(server, team, tmp_path, "resumable", RESUMABLE)
    client = server.client(team)
    wait_state(client, job["id"], "RUNNING", timeout=60)
    step_file = Path(job["checkpoint_dir"], "step")
    wait_for(lambda: step_file.exists() and int(step_file.read_text() or 0) >= 3)
    [first] = slurm_jobs(cluster, job["id"])
    cluster.run("scontrol", "requeue", str(first["job_id"]))  # as a preemption does

    def second_attempt():
        ours = client.get(f"/jobs/{job['id']}")
        return ours["attempts"] == 2 and ours["state"] == "RUNNING" and ours

    requeued = wait_for(second_attempt, timeout=60)
    assert requeued["requeues"] == 1 and requeued["max_retries"] == 0  # no retry used
    assert [e["to_state"] for e in requeued["events"]][-3:] == ["RETRYING", "PENDING", "RUNNING"]
    retrying = next(e for e in requeued["events"] if e["to_state"] == "RETRYING")
    assert retrying["reason"].startswith("requeued by Slurm (restart 1); requeued (no retry used)")
    logs = logs_once(server, team, job, "attempt 2")
    # our scheduler placed it again as a new Slurm job; Slurm's own copy was cancelled
    slurm = slurm_jobs(cluster, job["id"])
    assert [j["job_state"] for j in slurm] == ["CANCELLED", "RUNNING"]
    starts = [int(line.split()[-1]) for line in logs.splitlines() if " starts at step " in line]
    assert starts[0] == 0 and starts[1] >= 3  # resumed where it was, not from zero
    done(job)
    assert wait_state(client, job["id"], "SUCCEEDED", timeout=60)["attempts"] == 2
    assert os.path.exists(job["checkpoint_dir"])


def test_down_stop_workloads_leaves_no_slurm_job_of_ours_behind(
    cluster, server, team, tmp_path
) -> None:
    """Last: it stops the server. `gpucloud down --stop-workloads` with the control plane's
    home finds its Slurm executor in the instance file and leaves no job of ours in Slurm."""
    jobs = [submit(server, team, tmp_path, name, HOLD) for name in ("left-a", "left-b")]
    for job in jobs:
        wait_state(server.client(team), job["id"], "RUNNING", timeout=60)
        wait_for(lambda j=job: [s["job_state"] for s in slurm_jobs(cluster, j["id"])] == [RUN])
    env = {**server.env, "GPUCLOUD_HOME": str(server.home)}
    down = subprocess.run(
        [GPUCLOUD, "down", "--stop-workloads"], env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert down.returncode == 0, down.stderr
    assert "stopped 2 job(s), now CANCELLED" in down.stdout, down.stdout
    assert server.proc.wait(timeout=30) == 0
    states = {j["name"]: j["job_state"] for j in slurm_jobs_of_all(cluster)}
    # ended by the stop's SIGTERM (exit 143: FAILED to Slurm), or scancelled after the grace
    assert {states[f"gpucloud-job-{job['id']}"] for job in jobs} <= {"FAILED", "CANCELLED"}
    assert not {"PENDING", "CONFIGURING", RUN, "COMPLETING"} & set(states.values()), states


RUN = "RUNNING"


def slurm_jobs_of_all(cluster: SlurmCluster) -> list[dict]:
    return json.loads(cluster.run("squeue", "--json", "--states=all"))["jobs"]
