"""Crash safety: SIGKILL the control plane while jobs run, start it again.

Live workloads are adopted (same pid, never started twice), one that ended while the
control plane was down is recorded from its exit file, one whose process vanished is
failed and retried, and the queue goes on with no GPU booked twice.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil

from .conftest import Server, wait_for, wait_state, workload_pids


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _running_devices(client) -> list[set[int]]:
    return [set(j["devices"]) for j in client.get("/jobs", state="RUNNING")]


def test_sigkill_and_restart_adopts_live_jobs_and_loses_none(shared_server: Server):
    # The session's server itself is killed and restarted: later tests use it as restarted.
    server = shared_server
    team = server.tenant("crash")
    marks = {name: server.area(team) / f"{name}.starts" for name in "abcd"}

    def job(name: str, gpus: int, body: str) -> int:
        cmd = f"echo $$ >> {marks[name]}; {body}"
        return team.post("/jobs", {"name": name, "gpus": gpus, "command": cmd, "max_retries": 0})[
            "id"
        ]

    a = job("a", 1, "sleep 4")  # still running at the restart: adopted
    b = job("b", 1, "sleep 1")  # ends while the control plane is down
    d = job("d", 1, 'test "$GPUCLOUD_ATTEMPT" -ge 2 || sleep 300')  # killed while down
    c = job("c", 2, "sleep 0.5")  # waits for GPUs throughout
    for j in (a, b, d):
        wait_state(team, j, "RUNNING")
    assert team.get(f"/jobs/{c}")["state"] == "PENDING"
    for m in (marks["d"], marks["b"]):
        wait_for(lambda m=m: m.exists() and m.read_text().strip())
    d_pids = workload_pids(server.home, f"job-{d}")

    server.kill()
    for pid in d_pids:  # d's whole sandbox dies with no record
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not workload_pids(server.home, f"job-{b}"))  # b finishes meanwhile
    server.start()

    done_b = wait_state(team, b, "SUCCEEDED")
    assert done_b["exit_code"] == 0 and done_b["attempts"] == 1
    while team.get(f"/jobs/{a}")["state"] == "RUNNING":
        devices = _running_devices(team)
        assert sum(len(s) for s in devices) == len(set().union(*devices)) <= 4
        time.sleep(0.1)
    done_a = wait_state(team, a, "SUCCEEDED")
    assert done_a["attempts"] == 1
    assert len(marks["a"].read_text().split()) == 1  # adopted, never started again

    done_d = wait_state(team, d, "SUCCEEDED")
    assert done_d["attempts"] == 2 and "RETRYING" in [e["to_state"] for e in done_d["events"]]
    assert any(
        "unknown" in (e["reason"] or "") or "lost" in (e["reason"] or "") for e in done_d["events"]
    )
    assert wait_state(team, c, "SUCCEEDED")["attempts"] == 1
    assert not any(_alive(p) for p in d_pids)
