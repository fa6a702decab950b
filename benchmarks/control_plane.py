"""Control-plane throughput: submit 10,000 jobs through the REST API, then time a
scheduling pass at that queue length over 1,000 nodes; on SQLite and on PostgreSQL.

A real `gpucloud server` (4 virtual GPUs) runs on 127.0.0.1 over a store that also holds
1,000 registered nodes of four GPU types, a fake inventory that no executor reaches. Every
node is cordoned (the fake ones from the start: the local executor would run their jobs on
this machine), so every job stays queued and each reconciler pass sees the whole queue and
every node. PostgreSQL is a throwaway server in a temp dir, as the tests start it.
Baselines measured in the same run:
  - API: GET /healthz on the same server and clients (no auth, no database);
  - scheduling pass: reading the same pending jobs and nodes with raw SQL queries.

    python benchmarks/control_plane.py [--jobs 10000] [--clients 8] [--nodes 1000]
        [--db sqlite|postgresql|both]
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
from sqlalchemy import select, text

from gpucloud.control import cluster, db
from gpucloud.control.executors.base import NodeInfo
from gpucloud.control.lifecycle import NodeState
from gpucloud.control.models import Node
from gpucloud.control.server import tune_gc
from gpucloud.control.services import nodes
from gpucloud.scheduler import Scheduler, get_policy

# The tests' throwaway PostgreSQL server (initdb + pg_ctl in a temp dir), reused as is.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "control"))
from pg import Postgres, pg_bin  # noqa: E402

GPU_TYPES = ("L4", "A100-80GB", "H100-SXM", "L40S")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _register_nodes(store: db.Store, count: int) -> None:
    """The fake inventory: `count` cordoned nodes of 8 GPUs, 64 cores and 512 GiB each, as
    an executor would report them (the server, whose executor does not, is told never to
    time them out)."""
    infos = [
        NodeInfo(
            f"fake-{i:04d}",
            GPU_TYPES[i % len(GPU_TYPES)],
            8,
            "cuda",
            "127.0.0.1",
            64_000,
            512 * 1024,
            {"fake": "true"},
        )  # fmt: skip
        for i in range(count)
    ]
    with store.transaction() as s:
        nodes.sync(s, infos, time.time(), timeout=float("inf"))
        for node in s.scalars(select(Node).where(Node.name.in_([i.name for i in infos]))):
            node.state = NodeState.CORDONED


def _start(home: Path, url: str, port: int) -> tuple[subprocess.Popen, str]:
    out = (home / "server.out").open("wb")
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "gpucloud"),
            "server",
            "--db",
            url,
            "--port",
            str(port),
            "--virtual-gpus",
            "4",
            "--node-timeout",
            "1e9",
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "GPUCLOUD_HOME": str(home)},
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    key = re.search(r"shown once\): (\S+)", (home / "server.out").read_text()).group(1)
    return proc, key


def _timed(n: int, clients: int, call: Callable[[int], None]) -> tuple[float, list[float]]:
    """(wall seconds, sorted latencies) of `n` calls from `clients`."""

    def one(i: int) -> float:
        t = time.perf_counter()
        call(i)
        return time.perf_counter() - t

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        latencies = list(pool.map(one, range(n)))
    return time.perf_counter() - t0, sorted(latencies)


def _timed_calls(
    n: int, clients: int, call: Callable[[int], None], server: psutil.Process
) -> tuple[float, list[float], float]:
    """(wall seconds, sorted latencies, server CPU seconds) of `n` calls from `clients`."""
    cpu0 = sum(server.cpu_times()[:2])
    wall, latencies = _timed(n, clients, call)
    return wall, latencies, sum(server.cpu_times()[:2]) - cpu0


def _p(xs: list[float], q: float) -> float:
    return xs[min(int(q * len(xs)), len(xs) - 1)]


PHASES = ("observe", "load", "decide", "apply")


def _pass_histogram(url: str) -> tuple[float, float, dict[str, float]]:
    """(seconds, count) of the passes so far, and the seconds of each phase."""
    m = httpx.get(url + "/metrics").text
    total = float(re.search(r"^gpucloud_scheduling_pass_seconds_sum (\S+)", m, re.M).group(1))
    count = float(re.search(r"^gpucloud_scheduling_pass_seconds_count (\S+)", m, re.M).group(1))
    phase = r'^gpucloud_scheduling_phase_seconds_total{{phase="{}"}} (\S+)'
    phases = {p: float(re.search(phase.format(p), m, re.M).group(1)) for p in PHASES}
    return total, count, phases


def _mean_pass(before: tuple, after: tuple) -> float | None:
    """The mean duration of the passes that ended between two reads of the pass histogram
    (None if none did: a pass longer than the interval is not a short one)."""
    ended = after[1] - before[1]
    return (after[0] - before[0]) / ended if ended else None


def _mean_phases(before: tuple, after: tuple) -> str:
    ended = after[1] - before[1]
    if not ended:
        return ""
    spent = {p: (after[2][p] - before[2][p]) / ended for p in PHASES}
    return " (" + ", ".join(f"{p} {spent[p] * 1e3:.0f} ms" for p in PHASES) + ")"


def _ms(seconds: float | None) -> str:
    return "no pass ended" if seconds is None else f"{seconds * 1e3:.0f} ms"


def _best(runs: int, fn: Callable[[], object]) -> float:
    """The shortest of `runs` timings of `fn` (the others were slowed by something else)."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _total(timed: tuple) -> float:
    return timed[0] + timed[1]


def run(db_url: str, label: str, args: argparse.Namespace) -> None:
    home = Path(tempfile.mkdtemp(prefix="gpucloud-bench-"))
    store = db.open_store(db_url)
    _register_nodes(store, args.nodes)
    port = _port()
    proc, key = _start(home, db_url, port)
    server = psutil.Process(proc.pid)
    url = f"http://127.0.0.1:{port}"
    try:
        admin = httpx.Client(
            base_url=url + "/api/v1", headers={"Authorization": f"Bearer {key}"}, timeout=120
        )
        for node in admin.get("/nodes").json():
            if node["state"] != "cordoned":
                admin.post(f"/nodes/{node['name']}/cordon").raise_for_status()
        http = [
            httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120)
            for _ in range(args.clients)
        ]

        def submit(i: int) -> None:
            body = {
                "name": f"job-{i}",
                "command": "sleep 60",
                "gpus": 1 + i % 4,
                "priority": ("low", "normal", "high")[i % 3],
            }
            http[i % args.clients].post("/api/v1/jobs", json=body).raise_for_status()

        def health(i: int) -> None:
            http[i % args.clients].get("/healthz").raise_for_status()

        n_health = min(args.jobs, 2000)
        base_wall, base_lat, base_cpu = _timed_calls(n_health, args.clients, health, server)
        wall, lat, cpu = _timed_calls(args.jobs, args.clients, submit, server)

        # The passes right after the burst place and explain the jobs it brought (each new
        # job's reason is written once); the steady pass at this queue length comes after.
        catch_up = _pass_histogram(url)
        time.sleep(5)
        steady = _pass_histogram(url)
        time.sleep(5)
        first_pass = _mean_pass(catch_up, steady)
        end = _pass_histogram(url)
        live_pass, live_phases = _mean_pass(steady, end), _mean_phases(steady, end)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    try:  # with the server stopped: its reconciler would share the CPU with these passes
        tune_gc()  # as the server's process has it
        scheduler = Scheduler(get_policy("priority").with_(quotas=True), explain=True)

        def one_pass(kept: cluster.LiveCluster) -> tuple[float, float, cluster.Snapshot]:
            t0 = time.perf_counter()
            with store.reading() as s:
                snap = kept.load(s, time.time())
            t1 = time.perf_counter()
            scheduler.schedule(snap.state, time.time())
            return t1 - t0, time.perf_counter() - t1, snap

        # cold: nothing kept (a restarted control plane's first pass); steady: the state
        # a reconciler keeps between passes, as the live one does
        cold = (one_pass(cluster.LiveCluster()) for _ in range(3))
        cold_load, cold_decide, _ = min(cold, key=_total)
        kept = cluster.LiveCluster()
        load_t, decide_t, snap = min((one_pass(kept) for _ in range(6)), key=_total)

        def raw_read() -> None:
            with store.engine.connect() as conn:
                conn.execute(
                    text(
                        "SELECT id, tenant_id, gpus, gpu_type, priority, preemptible, "
                        "submitted_at, cpu_milli, memory_mib, reason FROM jobs "
                        "WHERE state = 'PENDING'"
                    )
                ).all()
                conn.execute(
                    text(
                        "SELECT id, name, gpu_type, gpus, link_domain, cpu_milli, memory_mib, "
                        "state FROM nodes"
                    )
                ).all()

        raw = _best(5, raw_read)
        assert len(snap.state.pending) == args.jobs and len(snap.state.nodes) == args.nodes + 1
    finally:
        store.close()

    rate, base_rate = args.jobs / wall, n_health / base_wall
    per, base_per = cpu / args.jobs, base_cpu / n_health
    print(f"control plane, {args.jobs} jobs submitted by {args.clients} clients ({label})")
    print(
        f"  submissions/s         {rate:9.0f}   baseline GET /healthz/s {base_rate:9.0f}"
        f"   ratio {rate / base_rate:.2f}"
    )
    print(
        f"  API p50 latency       {_p(lat, 0.5) * 1e3:9.1f} ms  baseline "
        f"{_p(base_lat, 0.5) * 1e3:9.1f} ms   ratio {_p(lat, 0.5) / _p(base_lat, 0.5):.2f}"
    )
    print(
        f"  API p99 latency       {_p(lat, 0.99) * 1e3:9.1f} ms  baseline "
        f"{_p(base_lat, 0.99) * 1e3:9.1f} ms   ratio {_p(lat, 0.99) / _p(base_lat, 0.99):.2f}"
    )
    print(
        f"  server CPU/request    {per * 1e3:9.2f} ms  baseline {base_per * 1e3:9.2f} ms"
        f"   ratio {per / base_per:.2f}"
    )
    print(
        f"  scheduling pass at queue length {args.jobs} over {args.nodes + 1} nodes: load "
        f"{load_t * 1e3:.0f} ms + decide {decide_t * 1e3:.0f} ms = "
        f"{(load_t + decide_t) * 1e3:.0f} ms (nothing kept: "
        f"{(cold_load + cold_decide) * 1e3:.0f} ms); baseline raw SELECT of the queue and "
        f"nodes {raw * 1e3:.0f} ms   ratio {(load_t + decide_t) / raw:.1f}"
    )
    print(
        f"  live reconciler pass (server's /metrics, full queue): {_ms(live_pass)}"
        f" steady{live_phases} ({_ms(first_pass)} in the 5 s after the burst, explaining it);"
        f" baseline raw SELECT {raw * 1e3:.0f} ms   ratio "
        + (f"{live_pass / raw:.1f}" if live_pass is not None else "-")
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=1000, help="fake nodes registered")
    ap.add_argument("--db", choices=("sqlite", "postgresql", "both"), default="both")
    args = ap.parse_args()
    if args.db in ("sqlite", "both"):
        path = Path(tempfile.mkdtemp(prefix="gpucloud-bench-db-")) / "state.db"
        run(f"sqlite:///{path}", "SQLite", args)
    if args.db in ("postgresql", "both"):
        bindir = pg_bin()
        if bindir is None:
            sys.exit("PostgreSQL is not installed (tests/install_system_packages.sh installs it)")
        pg = Postgres(bindir)
        pg.start()
        try:
            run(pg.new_database(), "PostgreSQL", args)
        finally:
            pg.stop()


if __name__ == "__main__":
    main()
