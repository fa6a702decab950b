"""Deployments: replicas of the real `gpucloud serve` on a tiny model, admitted like jobs,
ready only when their /ready answers, restarted when they die, scaled and deleted with no
process left behind."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import psutil
import pytest

from .conftest import wait_for

# A fixed 4 MiB KV pool: without it each replica would size its pool from free memory.
ENGINE_ARGS = ["--kv-cache-bytes", str(1 << 22), "--log-level", "warning"]
# Seconds a replica may take to become ready on a loaded machine: the first `gpucloud serve`
# on a machine also compiles its CPU attention kernel (about a minute, then cached).
START = 600.0


@pytest.fixture(scope="module")
def http():
    """One client for all probes: each new httpx client costs ~40 ms of CPU (TLS setup)."""
    with httpx.Client(timeout=2) as client:
        yield client


def _answers_ready(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(url + "/ready").status_code == 200
    except httpx.TransportError:
        return False


def _serve_process(port: int) -> psutil.Process:
    """The `gpucloud serve` process listening on `port` (under the executor's shells)."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "serve" in cmd and "--port" in cmd and cmd[cmd.index("--port") + 1] == str(port):
            return p
    raise AssertionError(f"no gpucloud serve process on port {port}")


def _session(pid: int) -> set[int]:
    """Every live process of the workload session that `pid` belongs to."""
    sid = os.getsid(pid)
    out = set()
    for p in psutil.process_iter(["status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except (ProcessLookupError, PermissionError):
            pass
    return out


def _gone(pids: set[int]) -> bool:
    def dead(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    return all(dead(p) for p in pids)


def _complete(url: str) -> openai.types.Completion:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(
        model="chat", prompt="def main():", max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip


def _wait_ready(team, http: httpx.Client, name: str, n: int) -> tuple[dict, bool]:
    """Poll until `n` replicas are READY; every replica seen STARTING or READY must agree
    with its own /ready: READY only after it answered (probed after the state was read, a
    server not answering cannot have answered before)."""
    seen_starting_unready = False

    def check():
        nonlocal seen_starting_unready
        dep = team.get(f"/deployments/{name}")
        for r in dep["replica_list"]:
            if r["url"] is None or r["state"] not in ("STARTING", "READY"):
                continue
            if not _answers_ready(http, r["url"]):
                assert r["state"] == "STARTING", r
                seen_starting_unready = True
        return dep["ready_replicas"] == n and dep

    dep = wait_for(check, timeout=START)
    return dep, seen_starting_unready


def test_deployment_serves_restarts_scales_and_deletes(sqlite_server, tiny_model_dir, http):
    team = sqlite_server.tenant("serving")
    team.post(
        "/deployments",
        {"name": "chat", "model_dir": str(tiny_model_dir), "replicas": 2,
         "engine_args": ENGINE_ARGS},
    )  # fmt: skip
    dep, seen_unready = _wait_ready(team, http, "chat", 2)
    assert seen_unready  # a replica was STARTING while its server loaded: not yet READY
    replicas = dep["replica_list"]
    assert [r["state"] for r in replicas] == ["READY", "READY"]
    assert len({r["url"] for r in replicas}) == 2 and all(r["ready_at"] for r in replicas)
    for r in replicas:
        done = _complete(r["url"])
        assert done.model == "chat" and done.usage.completion_tokens == 5
        assert isinstance(done.choices[0].text, str) and done.choices[0].text
    procs = [_serve_process(r["port"]) for r in replicas]
    sessions = [_session(p.pid) for p in procs]

    procs[0].send_signal(signal.SIGKILL)  # the server crashes: the reconciler restarts it
    dep = wait_for(
        lambda: (
            (d := team.get("/deployments/chat"))["replica_list"][0]["restarts"] == 1
            and d["ready_replicas"] == 2
            and d
        ),
        timeout=START,
    )
    first = dep["replica_list"][0]
    assert first["state"] == "READY" and first["exit_code"] == 128 + signal.SIGKILL
    assert first["reason"].startswith("process exited: exit code 137 (SIGKILL); restart in ")
    assert dep["restarts"] == 1
    assert _gone(sessions[0])  # the crashed replica's shells went with it
    restarted = _serve_process(first["port"])
    assert restarted.pid != procs[0].pid
    assert _complete(first["url"]).usage.completion_tokens == 5

    assert team.post("/deployments/chat/scale", {"replicas": 1})["replicas"] == 1
    dep = wait_for(
        lambda: len((d := team.get("/deployments/chat"))["replica_list"]) == 1 and d, interval=0.05
    )
    assert dep["replica_list"][0]["index"] == 0 and dep["ready_replicas"] == 1
    wait_for(lambda: _gone(sessions[1]), timeout=15, interval=0.05)  # scaled away: no orphan

    last = _session(restarted.pid)
    team.delete("/deployments/chat")
    wait_for(lambda: team.get("/deployments") == [], interval=0.05)
    wait_for(lambda: _gone(last), timeout=15, interval=0.05)  # deleted: no orphan
    assert not _answers_ready(http, first["url"])
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
