"""The sandbox against an attacker: tenant A's workload tries to reach the control plane's
home, tenant B's files, environment and processes, to outlive its end and to exceed its
memory. Every attempt fails; B's workload keeps running."""

from __future__ import annotations

import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpucloud.control.sandbox import Identity, Limits, Sandbox, Spec, format_bytes

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching to a tenant's uid needs root")

UID_A, UID_B = 64501, 64502  # numeric identities: setpriv needs no passwd entry
B_SECRET = "b-environment-secret-" + uuid.uuid4().hex
B_ENV = {"B_SECRET": B_SECRET}
B_SLEEP = "sleep 6061"  # B's workload, as its command line shows on the host
PY = sys.executable


@dataclass
class Plane:
    """A control plane's home as the attacker finds it, and tenant B's running workload."""

    sandbox: Sandbox
    home: Path
    area_a: Path
    area_b: Path
    b_log: Path
    b_pid: int  # B's workload as the host sees it (its sleep, not the sandbox's wrapper)


@dataclass
class Ended:
    code: int
    log: str
    reason: str | None


def _area(home: Path, tenant: str, uid: int) -> Path:
    area = home / "tenants" / tenant
    area.mkdir(parents=True)
    os.chown(area, uid, uid)
    area.chmod(0o700)
    return area


def _spec(plane: Plane, name: str, command: str, **kw) -> Spec:
    uid, area = (UID_B, plane.area_b) if name.startswith("b-") else (UID_A, plane.area_a)
    return Spec(
        name=name,
        command=command,
        env=kw.pop("env", {}),
        cwd=area,
        log_path=plane.home / "logs" / f"{name}.log",
        exit_path=plane.home / "logs" / f"{name}.exit",
        identity=Identity(uid, uid),
        writable=(area,),
        hidden=(plane.home,),
        **kw,
    )


@pytest.fixture(scope="module")
def plane(tmp_path_factory) -> Plane:
    home = tmp_path_factory.mktemp("home")
    home.chmod(0o700)
    for secret in ("credentials.json", "state.db"):
        (home / secret).write_text(f"admin-secret in {secret}")
        (home / secret).chmod(0o600)
    (home / "logs").mkdir(mode=0o700)
    (home / "tenants").mkdir(mode=0o700)  # the tenants reach their areas all the same
    area_a, area_b = _area(home, "a", UID_A), _area(home, "b", UID_B)
    (area_b / "data.txt").write_text("tenant b's data")
    sandbox = Sandbox(f"gpucloud-test/{uuid.uuid4().hex[:8]}")
    plane = Plane(sandbox, home, area_a, area_b, home / "logs" / "b-main.log", 0)
    b = sandbox.start(_spec(plane, "b-main", f"echo b-log-line; exec {B_SLEEP}", env=B_ENV))
    try:
        deadline = time.monotonic() + 10
        while not (sleeping := _host_pids(B_SLEEP)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sleeping, "tenant B's workload did not start: " + plane.b_log.read_text()
        plane.b_pid = sleeping[0]
        yield plane
    finally:
        sandbox.stop("b-main", b.pid, grace=1)
        b.wait()
        sandbox.finish("b-main", b.pid)
        sandbox.close()


def _host_pids(cmdline: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if cmd.decode(errors="replace").strip() == cmdline:
                found.append(int(entry))
    return found


def _run_a(plane: Plane, command: str, **kw) -> Ended:
    name = f"a-{uuid.uuid4().hex[:8]}"
    spec = _spec(plane, name, command, **kw)
    proc = plane.sandbox.start(spec)
    code = proc.wait(timeout=60)
    reason = plane.sandbox.finish(name, proc.pid)
    return Ended(code, spec.log_path.read_text(), reason)


def _b_alive(plane: Plane) -> bool:
    return plane.sandbox.running("b-main", 0) and Path(f"/proc/{plane.b_pid}").exists()


@pytest.mark.parametrize("secret", ["credentials.json", "state.db"])
def test_a_cannot_read_the_control_planes_files(plane: Plane, secret: str):
    ended = _run_a(plane, f"cat {plane.home / secret}")
    assert ended.code != 0
    assert "admin-secret" not in ended.log


def test_a_cannot_read_bs_workdir_or_logs(plane: Plane):
    ended = _run_a(plane, f"cat {plane.area_b / 'data.txt'}; ls {plane.area_b}; cat {plane.b_log}")
    assert "tenant b's data" not in ended.log
    assert "b-log-line" not in ended.log
    assert "No such file or directory" in ended.log
    assert plane.b_log.read_text().startswith("b-log-line")  # B's log exists on the host


def test_a_cannot_read_bs_environment_through_proc(plane: Plane):
    ended = _run_a(plane, f"cat /proc/*/environ /proc/{plane.b_pid}/environ | tr '\\0' '\\n'")
    assert B_SECRET not in ended.log
    # Its own PID namespace: it sees the sandbox's init, its shell and its ps, nothing else.
    ps = _run_a(plane, "ls -d /proc/[0-9]* | wc -l")
    assert int(ps.log.split()[-1]) <= 4, ps.log


def test_the_environment_is_built_from_scratch(plane: Plane):
    os.environ["GPUCLOUD_SERVER_ONLY"] = "server-secret"
    try:
        ended = _run_a(plane, "env", env={"MINE": "1"})
    finally:
        del os.environ["GPUCLOUD_SERVER_ONLY"]
    assert "server-secret" not in ended.log
    variables = {line.split("=", 1)[0] for line in ended.log.splitlines()}
    assert variables <= {"MINE", "PATH", "PWD", "SHLVL", "_"}, variables


def test_a_cannot_write_into_the_home(plane: Plane):
    before = {p.name: p.read_bytes() for p in plane.home.iterdir() if p.is_file()}
    ended = _run_a(
        plane,
        f"echo pwned > {plane.home / 'credentials.json'}; touch {plane.home / 'pwned'}; "
        f"touch {plane.area_b / 'pwned'}; touch /usr/pwned; echo mine > own.txt",
    )
    assert ended.code == 0, ended.log  # the tmpfs took the writes; /usr said no
    assert "Read-only file system" in ended.log
    after = {p.name: p.read_bytes() for p in plane.home.iterdir() if p.is_file()}
    assert after == before
    assert not (plane.area_b / "pwned").exists() and not Path("/usr/pwned").exists()
    assert (plane.area_a / "own.txt").read_text() == "mine\n"  # its own area is writable
    assert (plane.area_a / "own.txt").stat().st_uid == UID_A


def test_a_cannot_kill_bs_processes(plane: Plane):
    ended = _run_a(plane, f"kill -9 {plane.b_pid}; kill -9 -1; pkill sleep; true")
    assert ended.code == 0
    time.sleep(0.1)
    assert _b_alive(plane)


def test_a_detached_child_is_gone_when_a_ends(plane: Plane):
    marker = "sleep 4242"
    ended = _run_a(plane, f"(setsid {marker} &) ; sh -c '{marker} &' ; exit 0")
    assert ended.code == 0
    assert _host_pids(marker) == []
    assert _b_alive(plane)


def test_stopping_a_kills_every_process_and_removes_its_cgroup(plane: Plane):
    name = "a-stopped"
    spec = _spec(
        plane,
        name,
        "trap 'echo got SIGTERM; exit 7' TERM; (setsid sleep 4343 &); sleep 600 & wait",
        limits=Limits(cpus=0.5, memory_bytes=256 << 20, pids=32),
    )
    proc = plane.sandbox.start(spec)
    cgroups = plane.sandbox.cgroups
    deadline = time.monotonic() + 10
    while not _host_pids("sleep 4343") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _host_pids("sleep 4343")
    if not cgroups.v2:  # the limits are the cgroup's
        group = {c: d / name for c, d in cgroups.dirs.items()}
        assert (group["memory"] / "memory.limit_in_bytes").read_text().strip() == str(256 << 20)
        assert (group["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "50000"
        assert (group["pids"] / "pids.max").read_text().strip() == "32"
    plane.sandbox.stop(name, proc.pid, grace=5)
    assert proc.wait(timeout=10) == 7  # the workload had its SIGTERM, and its grace
    assert plane.sandbox.finish(name, proc.pid) is None
    assert _host_pids("sleep 4343") == []
    assert all(not (d / name).exists() for d in cgroups.dirs.values())
    assert "got SIGTERM" in spec.log_path.read_text()
    assert _b_alive(plane)


def test_a_pids_limit_stops_a_fork_bomb(plane: Plane):
    bomb = (
        "import os, time\n"
        "forked = 0\n"
        "for _ in range(40):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "    except OSError:\n"
        "        break\n"
        "    forked += 1\n"
        'print("forked", forked)\n'
    )
    ended = _run_a(plane, f"{PY} -c '{bomb}'", limits=Limits(pids=16))
    assert "forked" in ended.log, ended.log
    assert int(ended.log.split()[-1]) < 16, ended.log
    assert _host_pids(f"{PY} -c {bomb}") == []  # the forks died with the workload


def test_a_memory_hog_is_killed_with_a_clear_reason(plane: Plane):
    limit = 64 << 20
    hog = f'{PY} -c \'x = b"x" * {3 * limit}; print("survived")\''
    ended = _run_a(plane, hog, limits=Limits(memory_bytes=limit))
    assert ended.code != 0
    assert "survived" not in ended.log
    assert ended.reason == "out of memory: limit 64 MiB"
    assert _b_alive(plane)


def test_a_workload_that_fits_its_memory_ends_normally(plane: Plane):
    fits = f"{PY} -c 'x = b\"x\" * (8 << 20); print(len(x))'"
    ended = _run_a(plane, fits, limits=Limits(memory_bytes=256 << 20))
    assert (ended.code, ended.log.strip(), ended.reason) == (0, str(8 << 20), None)


def test_root_is_refused(plane: Plane):
    spec = _spec(plane, "a-root", "true")
    spec = Spec(**{**{f: getattr(spec, f) for f in spec.__dataclass_fields__}, "identity": None})
    with pytest.raises(Exception, match="never runs as root"):
        plane.sandbox.start(spec)


def test_format_bytes():
    assert [format_bytes(n) for n in (1 << 30, 256 << 20, 3 << 29, 4096)] == [
        "1 GiB",
        "256 MiB",
        "1.5 GiB",
        "4096 bytes",
    ]


def test_the_wrapper_records_the_exit_code(plane: Plane):
    ended = _run_a(plane, "exit 3")
    assert ended.code == 3
    exits = sorted((plane.home / "logs").glob("a-*.exit"))
    assert exits and all(p.read_text().strip().isdigit() for p in exits)


def test_a_restarted_control_plane_adopts_a_workload_by_its_cgroup(plane: Plane):
    """A control plane that restarts is not the workload's parent: a new Sandbox of the
    same scope finds the workload by its cgroup name, stops it, and reads its exit code."""
    spec = _spec(plane, "a-adopted", "trap 'exit 5' TERM; sleep 6262 & wait")
    first = plane.sandbox.start(spec)
    wait = time.monotonic() + 10
    while not _host_pids("sleep 6262") and time.monotonic() < wait:
        time.sleep(0.02)
    restarted = Sandbox(plane.sandbox.scope)
    assert restarted.running("a-adopted", first.pid)
    restarted.stop("a-adopted", first.pid, grace=5)
    assert not restarted.running("a-adopted", first.pid)
    assert restarted.finish("a-adopted", first.pid) is None
    first.wait(timeout=10)
    assert spec.exit_path.read_text().strip() == "5"
    assert _host_pids("sleep 6262") == []
