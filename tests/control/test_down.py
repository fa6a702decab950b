"""Stopping `gpucloud up`: Ctrl-C leaves the workloads running for the next `gpucloud up` to
adopt, and `gpucloud down --stop-workloads` stops them all and records it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import psutil
from sqlalchemy import select

from gpucloud.control import db
from gpucloud.control.client import Client
from gpucloud.control.models import Job, Replica, UsageRecord

from .conftest import GPUCLOUD, free_port, wait_for, wait_state, workload_pids


class Up:
    """A `gpucloud up` process in its own process group, as a terminal runs it."""

    def __init__(self, home: Path, port: int) -> None:
        self.home, self.url = home, f"http://127.0.0.1:{port}"
        self.out = home / f"up-{len(list(home.glob('up-*.out')))}.out"
        cmd = [GPUCLOUD, "up", "--virtual-gpus", "2", "--port", str(port), "--grace", "2"]
        with self.out.open("w") as out:
            self.proc = subprocess.Popen(
                cmd, env=_env(home), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_for(lambda: self._healthy(), timeout=60)

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, self.out.read_text()
        try:
            return httpx.get(self.url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def client(self) -> Client:
        return Client(self.url, json.loads((self.home / "credentials.json").read_text())["api_key"])

    def wait(self) -> tuple[int, str]:
        return self.proc.wait(timeout=60), self.out.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCLOUD_")}
    return {**env, "GPUCLOUD_HOME": str(home)}


def _gpucloud(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [GPUCLOUD, *args], env=_env(home), capture_output=True, text=True, timeout=120
    )


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _started(mark: Path) -> str:
    """The pid (in its own PID namespace) a workload wrote into `mark` when it started."""
    return wait_for(lambda: mark.exists() and mark.read_text().split()[0])


def _area(home: Path, client) -> Path:
    """The client's tenant's area, where its workloads may write."""
    area = home / "tenants" / client.get("/me")["tenant"]
    area.mkdir(parents=True, exist_ok=True)
    return area


def test_ctrl_c_leaves_workloads_to_the_next_up_and_down_stops_them(tmp_path):
    home, port = tmp_path / "home", free_port()
    home.mkdir()
    up = Up(home, port)
    area = _area(home, up.client())
    marks = {name: area / f"{name}.pids" for name in ("a", "b", "web")}
    release = area / "release-a"
    workloads = [f"job-{n}" for n in (1, 2)] + ["replica-1"]
    try:
        wait_cmd = f"echo $$ >> {marks['a']}; while [ ! -e {release} ]; do sleep 0.1; done"
        a = up.client().post("/jobs", {"name": "a", "gpus": 1, "command": wait_cmd})["id"]
        wait_state(up.client(), a, "RUNNING")
        a_pid = _started(marks["a"])

        os.killpg(up.proc.pid, signal.SIGINT)  # Ctrl-C reaches the terminal's process group
        code, out = up.wait()
        assert code == 0, out
        assert (
            "control plane stopped; 1 workload(s) keep running: the next `gpucloud up` adopts "
            "them, `gpucloud down --stop-workloads` stops them" in out
        )
        assert workload_pids(home, f"job-{a}")  # its sandbox still holds it

        up = Up(home, port)  # adopts a: the same process goes on and its end is recorded
        second = _gpucloud(home, "up", "--virtual-gpus", "2", "--port", str(free_port()))
        assert second.returncode == 2 and "a control plane already runs for" in second.stderr
        release.touch()
        done = wait_state(up.client(), a, "SUCCEEDED")
        assert done["attempts"] == 1 and marks["a"].read_text().split() == [a_pid]

        team = up.client()
        b = team.post("/jobs", {"name": "b", "command": f"echo $$ >> {marks['b']}; sleep 600"})
        command = f"echo $$ >> {marks['web']}; sleep 600"
        team.post("/deployments", {"name": "web", "model_dir": "/m", "command": command})
        _started(marks["b"]), _started(marks["web"])
        pids = workload_pids(home, f"job-{b['id']}") + workload_pids(home, "replica-1")

        down = _gpucloud(home, "down", "--stop-workloads")
        assert down.returncode == 0, down.stderr
        assert f"stopping the control plane at {up.url}" in down.stdout
        assert "stopped 1 job(s), now CANCELLED, and 1 replica(s)" in down.stdout
        assert up.wait()[0] == 0
        assert not any(_alive(p) for p in pids)
        assert not any(workload_pids(home, w) for w in workloads)

        store = db.open_store(f"sqlite:///{home / 'state.db'}")
        with store.reading() as s:
            job_b = s.get(Job, b["id"])
            assert (job_b.state, job_b.reason, job_b.handle) == (
                "CANCELLED",
                "stopped by gpucloud down --stop-workloads",
                None,
            )
            assert [(r.state, r.handle) for r in s.scalars(select(Replica))] == [("PENDING", None)]
            assert all(u.ended_at is not None for u in s.scalars(select(UsageRecord)))
        store.close()

        again = _gpucloud(home, "down")
        assert again.returncode == 0 and "no control plane runs for" in again.stdout
        assert "no workloads are running" in again.stdout
    finally:
        up.kill()
        for w in workloads:  # nothing of this test outlives it, whatever failed
            for pid in workload_pids(home, w):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
