"""Without root the control plane cannot give each tenant its own OS user: it refuses to
start unless told --single-tenant, and then runs every workload sandboxed as its own user.
The server runs here in a user namespace where it is uid 65534, not root."""

from __future__ import annotations

import os
import subprocess

import pytest

from .conftest import GPUCLOUD, Server, free_port, wait_state

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="maps root to another uid")
AS_NOBODY = ("unshare", "--user", "--map-user=65534", "--map-group=65534")


def test_without_root_multi_tenant_mode_is_refused_saying_what_to_do(tmp_path):
    done = subprocess.run(
        [*AS_NOBODY, GPUCLOUD, "server", "--db", f"sqlite:///{tmp_path}/s.db",
         "--port", str(free_port()), "--virtual-gpus", "1"],
        env={**os.environ, "GPUCLOUD_HOME": str(tmp_path / "home")},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "multi-tenant mode needs root" in done.stderr and "--single-tenant" in done.stderr


def test_single_tenant_mode_runs_workloads_sandboxed_as_its_own_user(tmp_path):
    home = tmp_path / "home"
    server = Server(f"sqlite:///{tmp_path}/s.db", home, gpus=1,
                    extra=("--single-tenant",), wrapper=AS_NOBODY)  # fmt: skip
    server.start()
    try:
        team = server.tenant("solo")
        job = team.post(
            "/jobs",
            {"name": "who", "command": f"id -u; ls {home}; ls /proc | grep -c '^[0-9]'"},
        )
        done = wait_state(team, job["id"], "SUCCEEDED", "FAILED", timeout=60)
        log = team.get(f"/jobs/{job['id']}/logs").split()
        assert done["state"] == "SUCCEEDED", log
        assert log[0] == "65534"  # the control plane's own user
        assert log[1:-1] == ["tenants"]  # its home hidden but for the tenants' areas
        assert int(log[-1]) <= 4  # its own PID namespace
    finally:
        server.stop()
