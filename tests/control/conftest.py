"""Fixtures: a real PostgreSQL server, and real `gpucloud server` processes on 127.0.0.1.

Every server-backed test runs twice, on a SQLite file and on PostgreSQL.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from gpucloud.control.client import Client

from .pg import Postgres, pg_bin

GPUCLOUD = str(Path(sys.executable).parent / "gpucloud")
REQUEST_TIMEOUT = 3.0  # seconds the test servers give a request to arrive
PROBE_INTERVAL = 1.0  # seconds between health probes of a ready replica, and their timeout
BATCH_LEASE = 2.0  # seconds a server's claim on a batch lasts unless renewed


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    bindir = pg_bin()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed (make test installs it)")
    pg = Postgres(bindir)
    pg.start()
    yield pg
    pg.stop()


class ModelInit:
    """`gpucloud model init --preset tiny` in the background: started once the tests are
    collected, so the model is written while the first tests run."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpucloud-test-model-"))
        self.dir.chmod(0o755)  # served by the tenants' users, which must be able to read it
        self.path = self.dir / "tiny"  # the name clients ask for
        init = ["model", "init", "--preset", "tiny", "--seed", "0"]
        cmd = [GPUCLOUD, *init, "--out", str(self.path)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def wait(self) -> Path:
        out, _ = self.proc.communicate(timeout=600)
        assert self.proc.returncode == 0, out.decode()
        for f in self.path.iterdir():  # the weights are written 0600
            f.chmod(0o644)
        return self.path

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_model_init: ModelInit | None = None


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: only tests that will run count
def pytest_collection_modifyitems(items) -> None:
    global _model_init
    here = Path(__file__).parent
    if any(i.path.is_relative_to(here) and "tiny_model_dir" in i.fixturenames for i in items):
        _model_init = ModelInit()


def pytest_sessionfinish() -> None:
    if _model_init is not None:
        _model_init.close()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """A tiny random-weight model for deployments to serve."""
    global _model_init
    if _model_init is None:  # not foreseen at collection: start it now
        _model_init = ModelInit()
    return _model_init.wait()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path_factory) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path_factory.mktemp('db') / 'state.db'}"
    return request.getfixturevalue("postgres").new_database()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `gpucloud server` child process with its own GPUCLOUD_HOME."""

    def __init__(
        self,
        db_url: str,
        home: Path,
        gpus: int = 4,
        port: int | None = None,
        extra: tuple[str, ...] = (),
        wrapper: tuple[str, ...] = (),  # a command the server runs under (e.g. unshare)
    ) -> None:
        self.db_url, self.home, self.gpus = db_url, home, gpus
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra, self.wrapper = extra, wrapper
        self.proc: subprocess.Popen | None = None
        self.admin_key: str | None = None

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "GPUCLOUD_HOME": str(self.home), "GPUCLOUD_URL": self.url}

    def start(self) -> Server:
        self.home.mkdir(parents=True, exist_ok=True)
        out = (self.home / "server.out").open("ab")
        self.proc = subprocess.Popen(
            [
                *self.wrapper,
                GPUCLOUD,
                "server",
                "--db",
                self.db_url,
                "--port",
                str(self.port),
                "--virtual-gpus",
                str(self.gpus),
                "--min-run",
                "0",
                "--grace",
                "2",
                "--retry-backoff",
                "0.2",
                "--probe-interval",
                str(PROBE_INTERVAL),
                "--probe-failures",
                "3",
                "--reconcile-interval",
                "0.1",
                "--request-timeout",
                str(REQUEST_TIMEOUT),
                "--batch-lease",
                str(BATCH_LEASE),
                *self.extra,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=self.env,
        )
        deadline = time.monotonic() + 120
        with httpx.Client(timeout=1) as http:  # one client: each new one costs ~40 ms CPU
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, (self.home / "server.out").read_text()
                try:
                    if http.get(self.url + "/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.05)
            else:
                raise TimeoutError((self.home / "server.out").read_text())
        m = re.search(
            r"admin API key \(shown once\): (\S+)", (self.home / "server.out").read_text()
        )
        if m:
            self.admin_key = m.group(1)
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs, as in a crash."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """Stop the server, then what its workloads left (they outlive a control plane
        by design, to be adopted by the next one): each cgroup of its scope is killed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        kill_leftover_workloads(self.home)

    def client(self, key: str | None = None) -> Client:
        return Client(self.url, key or self.admin_key)

    def area(self, client: Client) -> Path:
        """The area of `client`'s tenant: the only dir of the home its workloads may write
        (made here if no workload made it yet; the control plane hands it to the tenant)."""
        path = self.home / "tenants" / client.get("/me")["tenant"]
        path.mkdir(parents=True, exist_ok=True)
        return path

    def tenant(self, name: str) -> Client:
        """A new tenant's admin client."""
        created = self.client().post("/tenants", {"name": name})
        return self.client(created["api_key"])


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.1):
    """Poll until `predicate()` returns something truthy; return it."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {predicate}")
        time.sleep(interval)


def workload_pids(home: Path, name: str) -> list[int]:
    """The host's pids of workload `name` (job-12, replica-5) of the control plane of
    `home`: its cgroup's."""
    from gpucloud.control.sandbox import Sandbox, scope_for

    cgroups = Sandbox(scope_for(home)).cgroups
    assert cgroups is not None
    return cgroups.members(name)


def kill_leftover_workloads(home: Path) -> None:
    """SIGKILL every workload still in a cgroup of the control plane of `home`'s scope."""
    from gpucloud.control.sandbox import Sandbox, scope_for

    cgroups = Sandbox(scope_for(home)).cgroups
    if cgroups is None:
        return
    first = next(iter(cgroups.dirs.values()))
    for group in first.iterdir() if first.is_dir() else ():
        if group.is_dir():
            cgroups.kill(group.name)
            cgroups.remove(group.name)


def host_pids(cmdline: str) -> list[int]:
    """The host's pids of the processes whose command line is `cmdline` (a workload's own
    pids are its PID namespace's, which the host does not see)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if " ".join(p.info["cmdline"] or ()) == cmdline and p.info["status"] != "zombie":
            found.append(p.pid)
    return found


def wait_state(client: Client, job_id: int, *states: str, timeout: float = 30.0) -> dict:
    return wait_for(lambda: (j := client.get(f"/jobs/{job_id}"))["state"] in states and j, timeout)


def _session_server(tmp_path_factory, url_of) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("home")
    srv = Server(url_of(home), home).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def sqlite_server(tmp_path_factory) -> Iterator[Server]:
    """One server for the whole session; tests keep apart by using their own tenants."""
    yield from _session_server(tmp_path_factory, lambda home: f"sqlite:///{home / 'state.db'}")


@pytest.fixture(scope="session")
def postgresql_server(tmp_path_factory, postgres) -> Iterator[Server]:
    yield from _session_server(tmp_path_factory, lambda home: postgres.new_database())


@pytest.fixture(params=["sqlite", "postgresql"])
def shared_server(request) -> Server:
    """The session's server on each database: every test using it runs on both. Tests of
    real replicas' lifecycles (starting, serving, scaling, dying) take `sqlite_server`
    alone: they spend their time in model servers, not in the store, whose SQL the other
    tests run on both databases."""
    return request.getfixturevalue(f"{request.param}_server")
