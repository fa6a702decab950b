"""Deployments: replicas admitted like jobs, ready only when /ready answers, restarted
when they die, scaled and deleted. Replicas run a stand-in server (see standin_server.py)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import httpx
import psutil

from .conftest import wait_for

STANDIN = f"{sys.executable} {Path(__file__).parent / 'standin_server.py'} {{port}}"


def _ready(team, name: str, n: int) -> dict:
    return wait_for(lambda: (d := team.get(f"/deployments/{name}"))["ready_replicas"] == n and d)


def test_deployment_lifecycle(shared_server):
    team = shared_server.tenant("serving")
    team.post(
        "/deployments",
        {"name": "chat", "model_dir": "/models/tiny", "replicas": 2, "command": STANDIN},
    )
    dep = _ready(team, "chat", 2)
    urls = [r["url"] for r in dep["replica_list"]]
    assert len(set(urls)) == 2 and all(r["state"] == "READY" for r in dep["replica_list"])
    pids = [httpx.get(u + "/ready").json()["pid"] for u in urls]

    os.kill(pids[0], signal.SIGKILL)  # a replica dies: it is restarted
    dep = wait_for(
        lambda: (
            (d := team.get("/deployments/chat"))["replica_list"][0]["restarts"] == 1
            and d["ready_replicas"] == 2
            and d
        )
    )
    assert httpx.get(dep["replica_list"][0]["url"] + "/ready").json()["pid"] != pids[0]

    assert team.post("/deployments/chat/scale", {"replicas": 1})["replicas"] == 1
    dep = wait_for(lambda: len((d := team.get("/deployments/chat"))["replica_list"]) == 1 and d)
    wait_for(
        lambda: (
            not psutil.pid_exists(pids[1])
            or psutil.Process(pids[1]).status() == psutil.STATUS_ZOMBIE
        )
    )

    last = httpx.get(dep["replica_list"][0]["url"] + "/ready").json()["pid"]
    team.delete("/deployments/chat")
    wait_for(lambda: team.get("/deployments") == [])
    wait_for(
        lambda: not psutil.pid_exists(last) or psutil.Process(last).status() == psutil.STATUS_ZOMBIE
    )
    lines = team.get("/usage")["lines"]
    assert [(x["kind"], x["name"]) for x in lines] == [("deployment", "chat")]
    assert lines[0]["gpu_hours"] > 0


def test_a_replica_that_never_gets_ready_is_not_reported_ready(shared_server):
    team = shared_server.tenant("notready")
    team.post(
        "/deployments", {"name": "mute", "model_dir": "/m", "replicas": 1, "command": "sleep 30"}
    )
    dep = wait_for(
        lambda: (d := team.get("/deployments/mute"))["replica_list"][0]["state"] == "STARTING" and d
    )
    assert dep["ready_replicas"] == 0
    team.delete("/deployments/mute")
    wait_for(lambda: team.get("/deployments") == [])
