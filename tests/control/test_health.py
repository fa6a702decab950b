"""Replicas that die are replaced: the control plane probes each READY replica's /health;
one whose engine loop died, or that stops answering, is marked FAILED with the reason, is
stopped with its whole process group and restarted after a backoff, and requests through
/v1 succeed again with no manual step."""

from __future__ import annotations

import contextlib
import signal
import subprocess

import openai
import psutil
import pytest

from gpucloud.serve.api import faults

from .conftest import GPUCLOUD, wait_for
from .test_deployments import ENGINE_ARGS, START, _gone, _serve_process, _session


@pytest.fixture
def server(sqlite_server):
    """Processes and probes are under test here, not the store: SQLite is enough."""
    return sqlite_server


def _ready(team, restarts: int) -> dict:
    """The deployment's replica once it is READY after `restarts` restarts."""
    return wait_for(
        lambda: (
            (r := team.get("/deployments/heal")["replica_list"][0])["state"] == "READY"
            and r["restarts"] == restarts
            and r
        ),
        timeout=START,
    )


def _completes(oa: openai.OpenAI) -> bool:
    """Whether a completion through the gateway succeeds now (the gateway may still route
    by what it read up to a second ago: a replica that just came up, or just went away)."""
    try:
        done = oa.completions.create(model="heal", prompt="def main():", max_tokens=5,
                                     temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    except openai.APIError:
        return False
    return done.usage.completion_tokens == 5


def _cli_table(server, key: str, *args: str) -> dict[str, str]:
    """The first row of the table a `gpucloud` command prints, by column."""
    env = {**server.env, "GPUCLOUD_API_KEY": key}
    out = subprocess.run([GPUCLOUD, *args], env=env, capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    header = next(line for line in lines if line.startswith("┃"))
    row = next(line for line in lines if line.startswith("│"))
    names = [c.strip() for c in header.strip("┃").split("┃")]
    return dict(zip(names, [c.strip() for c in row.strip("│").split("│")], strict=True))


def test_a_replica_whose_engine_died_or_that_hangs_is_replaced(server, tiny_model_dir):
    key = server.client().post("/tenants", {"name": "healing"})["api_key"]
    team = server.client(key)
    team.post("/deployments", {"name": "heal", "model_dir": str(tiny_model_dir), "replicas": 1,
                               "engine_args": ENGINE_ARGS, "env": {faults.ENV: "1"}})  # fmt: skip
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
    log = server.home / "server.out"
    stopped: list[psutil.Process] = []
    try:
        replica = _ready(team, restarts=0)
        assert wait_for(lambda: _completes(oa), timeout=30)

        # its engine loop dies: /health says so, and one probe is enough
        engine_dead = _serve_process(replica["port"])
        group = _session(engine_dead.pid)
        engine_dead.send_signal(signal.SIGUSR1)
        replica = _ready(team, restarts=1)
        assert replica["reason"].startswith("/health answered 503 (engine failed); restart in ")
        assert _gone(group)  # stopped with its whole process group
        assert wait_for(lambda: _completes(oa), timeout=30)

        # it stops answering (SIGSTOP): replaced once 3 probes in a row got no answer
        hung = _serve_process(replica["port"])
        stopped.append(hung)
        group = _session(hung.pid)
        hung.send_signal(signal.SIGSTOP)
        replica = _ready(team, restarts=2)
        assert replica["reason"].startswith(
            "3 health probes failed in a row, the last: /health did not answer within 1 s; "
        )
        assert _gone(group)
        assert wait_for(lambda: _completes(oa), timeout=30)

        assert team.get("/deployments/heal")["restarts"] == 2
        assert _cli_table(server, key, "deploy", "get", "heal")["restarts"] == "2"
        said = f"replica {replica['id']} failed: "
        failures = [line for line in log.read_text().splitlines() if said in line]
        assert [line.split(said)[1] for line in failures] == [
            "/health answered 503 (engine failed)",
            "3 health probes failed in a row, the last: /health did not answer within 1 s",
        ]  # each failure logged once, not once per pass
    finally:
        for proc in stopped:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGCONT)
        team.delete("/deployments/heal")
        wait_for(lambda: team.get("/deployments") == [], timeout=30)
