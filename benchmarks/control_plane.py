"""Control-plane throughput: submit 10,000 jobs through the REST API, then time a
scheduling pass at that queue length.

A real `gpucloud server` (SQLite, 4 virtual GPUs) runs on 127.0.0.1 with its node
cordoned, so every job stays queued and each reconciler pass sees the whole queue.
Baselines measured in the same run:
  - API: GET /healthz on the same server and clients (no auth, no database);
  - scheduling pass: reading the same pending rows with one raw SQL query.

    python benchmarks/control_plane.py [--jobs 10000] [--clients 8]
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from sqlalchemy import text

from gpucloud.control import cluster, db
from gpucloud.scheduler import Scheduler, get_policy


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(home: Path, port: int) -> tuple[subprocess.Popen, str]:
    out = (home / "server.out").open("wb")
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "gpucloud"),
            "server",
            "--db",
            f"sqlite:///{home / 'state.db'}",
            "--port",
            str(port),
            "--virtual-gpus",
            "4",
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "GPUCLOUD_HOME": str(home)},
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    key = re.search(r"shown once\): (\S+)", (home / "server.out").read_text()).group(1)
    return proc, key


def _timed_calls(n: int, clients: int, call) -> tuple[float, list[float]]:
    def one(i: int) -> float:
        t = time.perf_counter()
        call(i)
        return time.perf_counter() - t

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        latencies = list(pool.map(one, range(n)))
    return time.perf_counter() - t0, sorted(latencies)


def _p(xs: list[float], q: float) -> float:
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def _pass_histogram(url: str) -> tuple[float, float]:
    m = httpx.get(url + "/metrics").text
    total = float(re.search(r"^gpucloud_scheduling_pass_seconds_sum (\S+)", m, re.M).group(1))
    count = float(re.search(r"^gpucloud_scheduling_pass_seconds_count (\S+)", m, re.M).group(1))
    return total, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--clients", type=int, default=8)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="gpucloud-bench-"))
    port = _port()
    proc, key = _start(home, port)
    url = f"http://127.0.0.1:{port}"
    try:
        admin = httpx.Client(
            base_url=url + "/api/v1", headers={"Authorization": f"Bearer {key}"}, timeout=120
        )
        node = admin.get("/nodes").json()[0]["name"]
        admin.post(f"/nodes/{node}/cordon").raise_for_status()
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
        base_wall, base_lat = _timed_calls(n_health, args.clients, health)
        wall, lat = _timed_calls(args.jobs, args.clients, submit)

        s0, c0 = _pass_histogram(url)
        time.sleep(5)
        s1, c1 = _pass_histogram(url)
        live_pass = (s1 - s0) / max(c1 - c0, 1)

        store = db.open_store(f"sqlite:///{home / 'state.db'}")
        scheduler = Scheduler(get_policy("priority").with_(quotas=True))
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            with store.transaction() as s:
                snap = cluster.load(s)
            t1 = time.perf_counter()
            scheduler.schedule(snap.state, time.time())
            runs.append((t1 - t0, time.perf_counter() - t1))
        load_t, decide_t = min(runs, key=sum)
        raws = []
        for _ in range(3):
            t0 = time.perf_counter()
            with store.engine.connect() as conn:
                rows = conn.execute(
                    text(
                        "SELECT id, tenant_id, gpus, gpu_type, priority, preemptible, submitted_at "
                        "FROM jobs WHERE state = 'PENDING'"
                    )
                ).all()
            raws.append(time.perf_counter() - t0)
        raw = min(raws)
        assert len(rows) == args.jobs and len(snap.state.pending) == args.jobs
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    rate, base_rate = args.jobs / wall, n_health / base_wall
    print(f"control plane, {args.jobs} jobs submitted by {args.clients} clients (SQLite)")
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
        f"  scheduling pass at queue length {args.jobs}: load {load_t * 1e3:.0f} ms + decide "
        f"{decide_t * 1e3:.0f} ms = {(load_t + decide_t) * 1e3:.0f} ms;"
        f" baseline raw SELECT of the queue {raw * 1e3:.0f} ms   ratio "
        f"{(load_t + decide_t) / raw:.1f}"
    )
    print(f"  live reconciler pass (server's /metrics, full queue): {live_pass * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
