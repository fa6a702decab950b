"""Jobs run by the local executor behind a real server: logs, retries, cancel, preemption
with resume from a checkpoint, device pinning."""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path

import httpx
import psutil

from gpucloud.control import executors
from gpucloud.control.config import Settings
from gpucloud.control.executors.base import Launch, NodePart, WorkloadRef
from gpucloud.control.models import Node
from gpucloud.control.sandbox import Identity
from gpucloud.control.workloads import _device_env, device_nodes

from .conftest import host_pids, wait_for, wait_state

COUNTER = Path(__file__).parents[2] / "examples" / "jobs" / "counter.py"
_names = itertools.count()


def _team(server):
    return server.tenant(f"jobs-{next(_names)}")


def test_job_output_is_logged_and_followed_until_the_end(shared_server):
    team = _team(shared_server)
    job = team.post(
        "/jobs",
        {"name": "talk", "gpus": 1, "command": "for i in 1 2 3; do echo line $i; sleep 0.2; done"},
    )
    streamed = "".join(team.stream(f"/jobs/{job['id']}/logs", follow="true"))
    assert streamed.split() == ["line", "1", "line", "2", "line", "3"]
    done = wait_state(team, job["id"], "SUCCEEDED")
    assert done["exit_code"] == 0 and done["attempts"] == 1
    assert [e["to_state"] for e in done["events"]] == ["PENDING", "RUNNING", "SUCCEEDED"]
    assert team.get(f"/jobs/{job['id']}/logs") == streamed
    # What other users of the machine may not read: the home, its logs, the store.
    home = shared_server.home
    paths = [home, home / "logs", home / "logs" / f"job-{job['id']}.log"]
    if shared_server.db_url.startswith("sqlite:///"):
        paths.append(Path(shared_server.db_url.removeprefix("sqlite:///")))
    modes = {str(p): oct(p.stat().st_mode & 0o777) for p in paths}
    assert set(modes.values()) <= {"0o700", "0o600"}, modes


def test_a_job_that_fails_twice_then_succeeds(shared_server):
    team = _team(shared_server)
    job = team.post(
        "/jobs",
        {
            "name": "flaky",
            "gpus": 1,
            "max_retries": 2,
            "command": 'echo "attempt $GPUCLOUD_ATTEMPT"; test "$GPUCLOUD_ATTEMPT" -ge 3',
        },
    )
    done = wait_state(team, job["id"], "SUCCEEDED", "FAILED")
    assert done["state"] == "SUCCEEDED" and done["attempts"] == 3
    states = [e["to_state"] for e in done["events"]]
    assert states.count("RETRYING") == 2 and states[-1] == "SUCCEEDED"
    assert team.get(f"/jobs/{job['id']}/logs").split() == [
        "attempt",
        "1",
        "attempt",
        "2",
        "attempt",
        "3",
    ]


def test_a_job_out_of_retries_fails_with_its_exit_code(shared_server):
    team = _team(shared_server)
    job = team.post("/jobs", {"name": "bad", "gpus": 1, "command": "exit 3", "max_retries": 1})
    done = wait_state(team, job["id"], "FAILED")
    assert done["exit_code"] == 3 and done["attempts"] == 2
    assert "no retries left" in done["reason"]


def test_cancel_kills_everything_the_job_started(shared_server):
    """A child in the background and one detached with setsid both die with the job."""
    team = _team(shared_server)
    child, detached = f"sleep 300.{os.getpid()}1", f"sleep 300.{os.getpid()}2"
    job = team.post(
        "/jobs", {"name": "tree", "gpus": 1, "command": f"{child} & setsid {detached} & wait"}
    )
    wait_state(team, job["id"], "RUNNING")
    pids = wait_for(lambda: len(found := host_pids(child) + host_pids(detached)) == 2 and found)
    team.post(f"/jobs/{job['id']}/cancel")
    done = wait_state(team, job["id"], "CANCELLED")
    assert done["finished_at"] is not None
    wait_for(
        lambda: all(
            not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE
            for p in pids
        ),
        timeout=10,
    )


def test_concurrent_jobs_get_disjoint_devices(shared_server):
    team = _team(shared_server)
    jobs = [
        team.post(
            "/jobs", {"name": f"pin{i}", "gpus": 2, "command": "echo $GPUCLOUD_DEVICES; sleep 60"}
        )
        for i in range(2)
    ]
    for j in jobs:  # both at once (a short sleep let the first end before the second began)
        wait_state(team, j["id"], "RUNNING")
    seen = [
        set(wait_for(lambda j=j: team.get(f"/jobs/{j['id']}/logs").strip()).split(","))
        for j in jobs
    ]
    for j in jobs:
        team.post(f"/jobs/{j['id']}/cancel")
    assert seen[0].isdisjoint(seen[1]) and seen[0] | seen[1] == {"0", "1", "2", "3"}
    for j in jobs:
        wait_state(team, j["id"], "CANCELLED")


def test_device_pinning_uses_the_backends_variable():
    cuda = Node(name="g1", backend="cuda", gpu_type="H100-SXM", gpus=8)
    npu = Node(name="a1", backend="npu", gpu_type="Ascend-910B", gpus=8)
    assert _device_env(cuda, [1, 2])["CUDA_VISIBLE_DEVICES"] == "1,2"
    assert _device_env(npu, [3])["ASCEND_RT_VISIBLE_DEVICES"] == "3"


def test_a_workloads_sandbox_shows_only_its_own_gpus_device_nodes(tmp_path):
    """Its /dev holds the driver's shared nodes and its own GPUs', none of another
    workload's; CUDA then numbers its GPUs from 0, while GPUCLOUD_DEVICES keeps the node's."""
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert device_nodes("cuda", [1, 2], tmp_path) == [
        tmp_path / "nvidiactl", tmp_path / "nvidia-uvm", tmp_path / "nvidia1", tmp_path / "nvidia2"
    ]  # fmt: skip
    assert device_nodes("cpu", [0], tmp_path) == [] and device_nodes("npu", [0], tmp_path) == []
    cuda = Node(name="g", gpu_type="A100-80GB", gpus=4, backend="cuda")
    env = _device_env(cuda, [1, 2], device_nodes("cuda", [1, 2], tmp_path))
    assert (env["CUDA_VISIBLE_DEVICES"], env["GPUCLOUD_DEVICES"]) == ("0,1", "1,2")


def test_preempted_job_resumes_from_its_checkpoint(shared_server):
    team = _team(shared_server)
    ckpt = shared_server.area(team) / "ckpt"
    low = team.post(
        "/jobs",
        {
            "name": "low",
            "gpus": 4,
            "priority": "low",
            "preemptible": True,
            "command": f"{sys.executable} {COUNTER} 30 0.1",
            "checkpoint_dir": "ckpt",  # in the tenant's area
        },
    )
    wait_for(lambda: (ckpt / "step").exists() and int((ckpt / "step").read_text()) >= 3)
    high = team.post(
        "/jobs", {"name": "high", "gpus": 4, "priority": "high", "command": "sleep 0.3"}
    )
    wait_state(team, high["id"], "SUCCEEDED")
    done = wait_state(team, low["id"], "SUCCEEDED", timeout=60)
    assert done["preemptions"] == 1 and done["attempts"] == 2
    states = [e["to_state"] for e in done["events"]]
    assert states == ["PENDING", "RUNNING", "PREEMPTED", "PENDING", "RUNNING", "SUCCEEDED"]
    log = team.get(f"/jobs/{low['id']}/logs").splitlines()
    resumed = int(log[1].split(" starts at step ")[1].split()[0])
    assert log[0].startswith("attempt 1 starts at step 0") and resumed >= 3
    assert log[-1] == "done at step 30"


def test_usage_counts_gpu_seconds_at_catalog_prices(shared_server):
    team = _team(shared_server)
    job = team.post("/jobs", {"name": "paid", "gpus": 2, "command": "sleep 1"})
    done = wait_state(team, job["id"], "SUCCEEDED")
    report = team.get("/usage")
    (line,) = report["lines"]
    ran = done["finished_at"] - done["started_at"]
    assert line["name"] == "paid" and line["gpu_type"] == "L4"
    assert abs(line["gpu_hours"] - 2 * ran / 3600) < 2 * 0.5 / 3600
    assert abs(line["cost"] - line["gpu_hours"] * 0.70) < 1e-9
    tenant = team.get("/me")["tenant"]
    assert report["tenants"][tenant]["gpu_hours"] == line["gpu_hours"]
    assert team.get("/usage", since=time.time() + 3600)["lines"] == []
    assert os.environ.get("GPUCLOUD_PRICES") is None  # prices are the catalog's


def test_a_job_that_cannot_start_fails_after_its_retries_saying_why(shared_server):
    """Neither a workdir that cannot exist nor a missing command is retried past
    max_retries, and the reason says what went wrong."""
    team = _team(shared_server)
    blocker = shared_server.area(team) / "a-file"
    blocker.write_text("not a directory")
    nowhere = team.post("/jobs", {"name": "nowhere", "command": "true", "max_retries": 2,
                                  "workdir": str(blocker / "work")})  # fmt: skip
    missing = team.post("/jobs", {"name": "missing", "command": "no-such-command-here",
                                  "max_retries": 1})  # fmt: skip
    done = wait_state(team, nowhere["id"], "FAILED")
    assert done["attempts"] == 3 and done["exit_code"] is None
    assert done["reason"].startswith("could not start: ") and "Not a directory" in done["reason"]
    assert done["reason"].endswith("no retries left")
    retries = [e["reason"] for e in done["events"] if e["to_state"] == "RETRYING"]
    assert len(retries) == 2 and all("Not a directory" in r for r in retries)
    done = wait_state(team, missing["id"], "FAILED")
    assert done["attempts"] == 2 and done["exit_code"] == 127
    assert done["reason"] == "exit code 127 (command not found); no retries left"
    assert "no-such-command-here" in team.get(f"/jobs/{missing['id']}/logs")


def test_the_checkpoint_dir_is_made_before_the_job_starts(shared_server):
    """examples/jobs/counter.yaml names a checkpoint_dir that does not exist yet; the job
    writes into it from its first step."""
    from gpucloud.control import specfile
    from gpucloud.control.schemas import JobSpec

    spec = specfile.load(COUNTER.with_name("counter.yaml"), JobSpec).model_dump(exclude_none=True)
    team = _team(shared_server)
    ckpt = shared_server.area(team) / "not" / "yet" / spec["checkpoint_dir"]
    spec |= {"command": f"{sys.executable} {COUNTER} 3 0.01", "checkpoint_dir": str(ckpt)}
    job = team.post("/jobs", spec)
    done = wait_state(team, job["id"], "SUCCEEDED", "FAILED", "RETRYING")
    assert done["state"] == "SUCCEEDED", done
    assert (ckpt / "step").read_text() == "3"


def test_a_run_past_its_time_limit_is_stopped_gently_and_fails_without_retry(shared_server):
    """SIGTERM at the limit (a training job saves its checkpoint then), SIGKILL after the
    grace period; the next run would meet the same limit, so none is tried."""
    team = _team(shared_server)
    job = team.post(
        "/jobs",
        {
            "name": "long",
            "gpus": 1,
            "max_retries": 2,
            "time_limit": "2s",
            "command": "trap 'echo saving; exit 0' TERM; echo started; sleep 60 & wait",
        },
    )
    assert job["time_limit"] == 2.0
    done = wait_state(team, job["id"], "FAILED", timeout=30)
    assert done["reason"] == "time limit 2s reached" and done["attempts"] == 1
    assert done["finished_at"] - done["started_at"] >= 2.0
    assert team.get(f"/jobs/{job['id']}/logs").split() == ["started", "saving"]


def test_a_time_limit_is_a_duration(shared_server):
    team = _team(shared_server)
    with httpx.Client(base_url=shared_server.url + "/api/v1", headers=team._http.headers) as http:
        for bad, says in (("2 hours", "is not a duration"), (0.5, "greater than or equal to 1")):
            r = http.post("/jobs", json={"name": "x", "command": "true", "time_limit": bad})
            assert r.status_code == 422 and says in r.text, r.text
    ok = team.post("/jobs", {"name": "y", "command": "true", "time_limit": "1h30m"})
    assert ok["time_limit"] == 5400.0


def test_a_workload_stopped_while_its_sandbox_starts_does_not_run_on(tmp_path):
    """A stop that came before the sandbox had made the workload's cgroup found nothing to
    kill, and the command then ran to its end while the stop waited for it (a deployment
    deleted right after its replica started held the reconciler for its whole run)."""
    settings = Settings(home=tmp_path / "home", virtual_gpus=1, node_name="n1")
    executor = executors.create(settings)
    area = tmp_path / "area"
    area.mkdir()
    os.chown(area, 64521, 64521)  # a numeric tenant identity: setpriv needs no passwd entry
    marker = area / "ran-on"
    launch = Launch(
        ref=WorkloadRef.job(1),
        command=f"sleep 2; touch {marker}",
        env={},
        cwd=area,
        log_path=settings.logs_dir / "job-1.log",
        parts=(NodePart("n1", "127.0.0.1", (), {}),),
        identity=Identity(64521, 64521),
        writable=(area,),
    )
    try:
        ended = executor.stop(executor.start(launch), grace=0)  # no grace: kill at once
        time.sleep(3)
        assert not marker.exists() and ended.code != 0
    finally:
        executor.close()
