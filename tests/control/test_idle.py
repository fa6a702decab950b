"""Idle reclaim on the session's SQLite server (its time goes to waiting out TTLs of
seconds, not to the store): a deployment without requests is warned, scaled to zero and
woken by the next request; an interactive job with no new output is warned and stopped.
The telemetry path (an interactive job whose GPUs report no use) is in
test_node_telemetry.py, on the server that records telemetry."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from gpucloud.errors import UserError

from . import fake_replica
from .conftest import GPUCLOUD, wait_for, wait_state


def _actions(admin, target: str) -> list[str]:
    return [e["action"] for e in reversed(admin.get("/audit")) if e["target"] == target]


def test_a_deployment_without_requests_is_warned_scaled_to_zero_and_woken(sqlite_server):
    server, admin = sqlite_server, sqlite_server.client()
    created = admin.post("/tenants", {"name": "idle-serve"})
    team, key = server.client(created["api_key"]), created["api_key"]
    env = {**server.env, "GPUCLOUD_API_KEY": server.admin_key}
    assert admin.put("/tenants/idle-serve/idle-ttl", {"idle_ttl": "4s"})["idle_ttl"] == 4
    team.post("/deployments", {"name": "quiet", **fake_replica.spec()})
    # The warning stands for the last fifth of the TTL only: on a loaded machine a poll may
    # miss it, so it is read where it stays, in the audit log (below), and while it shows:
    seen = wait_for(lambda: (d := team.get("/deployments/quiet"))["idle"] and d)
    if seen["replicas"] == 1:  # still the warning
        assert seen["idle"].startswith("idle: scaled to zero at ")
        assert seen["ready_replicas"] == 1 and seen["idle_ttl"] is None  # the tenant's TTL
    assert "# HELP gpucloud_idle_reclaim_in_seconds" in httpx.get(server.url + "/metrics").text
    listed = subprocess.run(
        [GPUCLOUD, "deploy", "list"], env={**env, "GPUCLOUD_API_KEY": key, "COLUMNS": "400"},
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    assert "scaled to zero" in listed  # warned, or already reclaimed
    reclaimed = wait_for(lambda: (d := team.get("/deployments/quiet"))["replicas"] == 0 and d)
    assert reclaimed["idle"] == (
        "scaled to zero while idle: the next request starts its 1 replica(s) again"
    )
    wait_for(lambda: not team.get("/deployments/quiet")["replica_list"])
    (entry,) = [e for e in admin.get("/audit") if e["action"] == "deployment.idle_reclaim"
                and e["target"] == "deployment/quiet"]  # fmt: skip
    assert entry["detail"]["done"] == "scaled to zero"
    assert entry["detail"]["why"].startswith("no request for 4")

    answer = httpx.post(server.url + "/v1/completions", json={"model": "quiet", "prompt": "x"},
                        headers={"Authorization": f"Bearer {key}"}, timeout=120)  # fmt: skip
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "ok"
    woken = team.get("/deployments/quiet")
    assert woken["replicas"] == 1 and woken["idle"] is None
    assert _actions(admin, "deployment/quiet") == [
        "deployment.create", "deployment.idle_warning", "deployment.idle_reclaim",
        "deployment.idle_wake",
    ]  # fmt: skip
    team.delete("/deployments/quiet")


def test_an_interactive_job_with_no_new_output_is_warned_then_stopped(sqlite_server, tmp_path):
    server, admin = sqlite_server, sqlite_server.client()
    key = admin.post("/tenants", {"name": "idle-box"})["api_key"]
    team = server.client(key)
    with pytest.raises(
        UserError, match="idle_ttl is for interactive jobs: add 'interactive: true'"
    ):
        team.post("/jobs", {"name": "x", "command": "true", "idle_ttl": "1m"})
    spec = tmp_path / "box.yaml"
    spec.write_text("name: box\ncommand: exec sleep 120\n")
    out = subprocess.run(
        [GPUCLOUD, "job", "submit", str(spec), "--no-upload", "--interactive", "--idle-ttl",
         "2s", "--json"],
        env={**server.env, "GPUCLOUD_API_KEY": key}, capture_output=True, text=True,
        check=True, timeout=60,
    ).stdout  # fmt: skip
    job = json.loads(out)
    assert job["interactive"] and job["idle_ttl"] == 2

    # The warning's fifth of the TTL is 0.4 s: the audit log (below) is where it is sure
    # to be seen; a poll that catches it sees it on the running job.
    def warned_or_stopped() -> dict | None:
        j = team.get(f"/jobs/{job['id']}")
        return j if j["idle"] or j["state"] == "CANCELLED" else None

    seen = wait_for(warned_or_stopped)
    if seen["state"] == "RUNNING":
        assert seen["idle"].startswith("idle: stopped at ")
    stopped = wait_state(team, job["id"], "CANCELLED")
    assert stopped["reason"].startswith("idle for 2")
    assert stopped["reason"].endswith("(no new output in its log or metrics.jsonl): stopped")
    assert _actions(admin, f"job/{job['id']}") == [
        "job.submit",
        "job.idle_warning",
        "job.idle_reclaim",
    ]
