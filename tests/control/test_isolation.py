"""Tenant A's jobs as an attacker, through a real server with two tenants: they try to read
the admin credentials, the store, tenant B's logs, workdir and environment, to write into
the control plane's home, to kill B's job, to outlive their end and to exceed their memory.
Every attempt fails, and B's job keeps running."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpucloud.control.client import Client
from gpucloud.errors import UserError

from .conftest import Server, host_pids, wait_for, wait_state

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="tenants' users need root")

B_SECRET = "b-environment-secret-" + uuid.uuid4().hex
B_SLEEP = f"sleep 7000.{os.getpid()}"  # B's job, as its command line shows on the host


@dataclass
class Plane:
    server: Server
    a: Client
    b: Client
    b_job: int
    b_pid: int  # B's sleep as the host sees it
    b_area: Path

    def b_alive(self) -> bool:
        running = self.b.get(f"/jobs/{self.b_job}")["state"] == "RUNNING"
        return running and host_pids(B_SLEEP) == [self.b_pid]


@pytest.fixture(scope="module")
def plane(sqlite_server: Server) -> Plane:
    server = sqlite_server
    credentials = server.home / "credentials.json"  # as `gpucloud up` saves it
    credentials.write_text(f'{{"api_key": "{server.admin_key}"}}')
    credentials.chmod(0o600)
    a, b = server.tenant("attacker-a"), server.tenant("victim-b")
    job = b.post(
        "/jobs",
        {
            "name": "victim",
            "command": f"echo b-log-line; echo b-data > data.txt; exec {B_SLEEP}",
            "env": {"B_SECRET": B_SECRET},
        },
    )
    wait_state(b, job["id"], "RUNNING")
    (pid,) = wait_for(lambda: host_pids(B_SLEEP))
    plane = Plane(server, a, b, job["id"], pid, server.area(b))
    yield plane
    b.post(f"/jobs/{job['id']}/cancel")
    wait_state(b, job["id"], "CANCELLED")


def _attack(plane: Plane, *commands: str, **spec) -> list[tuple[dict, str]]:
    """Run each command as one of A's jobs (all at once); their ends and logs."""
    jobs = [plane.a.post("/jobs", {"name": "attack", "command": c, **spec}) for c in commands]
    ended = [wait_state(plane.a, j["id"], "SUCCEEDED", "FAILED", timeout=60) for j in jobs]
    return [(j, plane.a.get(f"/jobs/{j['id']}/logs")) for j in ended]


def test_a_cannot_read_the_admin_credentials_the_store_or_bs_files(plane: Plane):
    home = plane.server.home
    b_log = home / "logs" / f"job-{plane.b_job}.log"
    b_work = plane.b_area / "work" / f"job-{plane.b_job}"
    (creds, store, logs, work) = _attack(
        plane,
        f"cat {home / 'credentials.json'}",
        f"cat {home / 'state.db'}",
        f"cat {b_log}",
        f"cat {b_work / 'data.txt'}; ls {plane.b_area}",
    )
    assert creds[0]["exit_code"] != 0 and plane.server.admin_key not in creds[1]
    assert store[0]["exit_code"] != 0 and "SQLite format" not in store[1]
    assert logs[0]["exit_code"] != 0 and "b-log-line" not in logs[1]
    assert work[0]["exit_code"] != 0 and "b-data" not in work[1]
    assert "b-log-line" in b_log.read_text()  # they exist, on the host
    assert (b_work / "data.txt").read_text() == "b-data\n"
    assert plane.b_alive()


def test_a_cannot_read_bs_environment_through_proc(plane: Plane):
    ((_, log),) = _attack(
        plane, f"cat /proc/*/environ /proc/{plane.b_pid}/environ | tr '\\0' '\\n'; ls /proc"
    )
    assert B_SECRET not in log
    assert "GPUCLOUD_HOME" not in log  # the server's environment is not inherited either
    assert plane.b_alive()


def test_a_runs_as_its_own_user_and_cannot_write_into_the_home(plane: Plane):
    home = plane.server.home
    written = ("server.out", "state.db", "state.db-wal", "state.db-shm")  # by the server
    before = {p.name: p.read_bytes() for p in home.iterdir() if p.is_file()}
    before = {name: data for name, data in before.items() if name not in written}
    ((job, log),) = _attack(
        plane,
        f"id -u; echo pwned > {home / 'credentials.json'}; touch {home / 'pwned'}; "
        f"touch {plane.b_area / 'pwned'}; touch /usr/pwned; echo mine > own.txt",
    )
    assert job["state"] == "SUCCEEDED", log  # the writes went to nothing of the host's
    assert int(log.split()[0]) not in (0, os.getuid())
    after = {p.name: p.read_bytes() for p in home.iterdir() if p.name in before}
    assert after == before
    assert not (home / "pwned").exists() and not (plane.b_area / "pwned").exists()
    assert not Path("/usr/pwned").exists()
    own = plane.server.area(plane.a) / "work" / f"job-{job['id']}" / "own.txt"
    assert own.read_text() == "mine\n" and own.stat().st_uid == int(log.split()[0])


def test_a_tenant_with_an_isolated_network_reaches_nothing_but_its_loopback(plane: Plane):
    """B's jobs share the host's network (the control plane's port answers, a key is needed);
    a job of a tenant created with network isolated sees only its own loopback."""
    port = plane.server.url.rsplit(":", 1)[1]
    probe = (
        'python3 -c \'import socket, sys; socket.create_connection(("127.0.0.1", '
        f'{port}), 2); print("reached")\'; cat /proc/net/dev | tail -n +3 | cut -d: -f1'
    )
    admin = plane.server.client()
    created = admin.post("/tenants", {"name": "walled", "network": "isolated"})
    assert created["network"] == "isolated"
    walled = plane.server.client(created["api_key"])
    job = walled.post("/jobs", {"name": "probe", "command": probe})
    wait_state(walled, job["id"], "SUCCEEDED", "FAILED", timeout=60)
    log = walled.get(f"/jobs/{job['id']}/logs")
    assert "reached" not in log and "Connection refused" in log, log
    assert log.split()[-1] == "lo", log  # no interface but its loopback
    ((job, log),) = _attack(plane, probe)
    assert "reached" in log, log
    with pytest.raises(UserError, match="network"):
        admin.post("/tenants", {"name": "bad-net", "network": "none"})
    assert plane.b_alive()


def test_every_workload_has_a_pids_limit(plane: Plane):
    from gpucloud.control.sandbox import Sandbox, scope_for

    cgroups = Sandbox(scope_for(plane.server.home)).cgroups
    assert cgroups is not None
    name = f"job-{plane.b_job}"
    limit = next(
        (d / name / "pids.max") for c, d in cgroups.dirs.items() if c in ("pids", "unified")
    )
    assert limit.read_text().strip() == "4096"


def test_a_cannot_kill_bs_job(plane: Plane):
    ((job, _),) = _attack(plane, f"kill -9 {plane.b_pid}; kill -9 -1; pkill sleep; true")
    assert job["state"] == "SUCCEEDED"
    assert plane.b_alive()


def test_a_detached_child_is_gone_when_as_job_ends(plane: Plane):
    marker = f"sleep 4242.{os.getpid()}"
    ((job, log),) = _attack(plane, f"(setsid {marker} &); sh -c '{marker} &'; exit 0")
    assert job["state"] == "SUCCEEDED", log
    assert host_pids(marker) == []
    assert plane.b_alive()


def test_a_memory_hog_fails_out_of_memory(plane: Plane):
    hog = 'python3 -c \'x = b"x" * (3 * 128 << 20); print("survived")\''
    ((job, log),) = _attack(plane, hog, memory_gib=0.125)
    assert job["state"] == "FAILED" and "survived" not in log
    assert job["reason"] == "out of memory: limit 128 MiB; no retries left"
    assert plane.b_alive()


def test_paths_outside_the_tenants_area_are_refused_at_submit(plane: Plane):
    for field, value in [
        ("workdir", str(plane.b_area)),
        ("workdir", "../victim-b"),
        ("checkpoint_dir", str(plane.server.home)),
        ("checkpoint_dir", "/etc"),
    ]:
        with pytest.raises(UserError, match=f"{field} .* is outside your area"):
            plane.a.post("/jobs", {"name": "x", "command": "true", field: value})
    job = plane.a.post("/jobs", {"name": "x", "command": "pwd", "workdir": "sub/dir"})
    assert job["workdir"] == str(plane.server.area(plane.a) / "sub" / "dir")
    wait_state(plane.a, job["id"], "SUCCEEDED")


def test_a_cannot_serve_bs_files_as_its_model(plane: Plane):
    """bwrap binds as root: a model dir A names is shown to A's replica only if A's user
    could read it anyway. B's model is refused with the reason; a link to it that A made in
    its own area leads nowhere inside A's sandbox."""
    (plane.b_area / "model").mkdir(exist_ok=True)
    (plane.b_area / "model" / "weights").write_text("b's weights")
    link = plane.server.area(plane.a) / "link"
    link.symlink_to(plane.b_area / "model")
    for name, model_dir in [("thief", plane.b_area / "model"), ("linker", link)]:
        plane.a.post(
            "/deployments",
            {"name": name, "model_dir": str(model_dir), "command": "cat {model_dir}/weights"},
        )
    refused = wait_for(lambda: plane.a.get("/deployments/thief")["replica_list"][0]["reason"])
    assert "cannot be read by tenant attacker-a's workloads" in refused, refused
    log = plane.server.home / "logs"
    found = wait_for(
        lambda: [p for p in log.glob("replica-*.log") if "weights" in p.read_text()], timeout=30
    )
    assert "No such file" in found[0].read_text() and "b's weights" not in found[0].read_text()
    for name in ("thief", "linker"):
        plane.a.delete(f"/deployments/{name}")
    assert plane.b_alive()
