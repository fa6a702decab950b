"""The /v1 gateway's cost: the same completions sent straight to a replica and through the
control plane's gateway, in the same run.

A real `gpucloud server` (SQLite, 4 virtual GPUs) runs one deployment of a tiny random
Llama (`gpucloud model init --preset tiny`) with one replica. Each round sends the same
requests both ways, alternating, and keeps each way's best round:
  - 1-token completions one at a time (the gateway's added latency);
  - 1-token completions from 8 clients at once (its effect on throughput);
  - 32-token streams one at a time (relaying a stream chunk by chunk).
The baseline is the direct path; the ratios are gateway / direct.

    python benchmarks/gateway.py [--requests 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from control_plane import _p, _port, _start, _timed


def tiny_model() -> Path:
    """`gpucloud model init --preset tiny` in a dir of its own that the tenants' workloads
    may read (each tenant's replicas run as its own OS user; the server's home is private)."""
    top = Path(tempfile.mkdtemp(prefix="gpucloud-bench-model-"))
    model = top / "tiny"
    gpucloud = str(Path(sys.executable).parent / "gpucloud")
    init = [gpucloud, "model", "init", "--preset", "tiny", "--seed", "0", "--out", str(model)]
    subprocess.run(init, check=True, capture_output=True)
    for path in (top, model, *model.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return model


# A replica's engine: a fixed 64 MiB KV pool (not sized from free memory), quiet logs.
ENGINE_ARGS = ["--kv-cache-bytes", str(1 << 26), "--log-level", "warning"]


@contextlib.contextmanager
def serving(prefix: str, deployment: dict) -> Iterator[tuple[str, str, httpx.Client]]:
    """A `gpucloud server` (SQLite, in a temp home named `prefix`...) with `deployment`
    created: its URL, the admin key and an admin client of /api/v1. On exit the deployment
    is deleted and its replicas waited for (they outlive the server), then the server
    stopped."""
    home = Path(tempfile.mkdtemp(prefix=prefix))
    port = _port()
    proc, key = _start(home, f"sqlite:///{home / 'state.db'}", port)
    url = f"http://127.0.0.1:{port}"
    admin = httpx.Client(
        base_url=url + "/api/v1", headers={"Authorization": f"Bearer {key}"}, timeout=120
    )
    try:
        admin.post("/deployments", json=deployment).raise_for_status()
        yield url, key, admin
    finally:
        admin.delete(f"/deployments/{deployment['name']}")
        deadline = time.monotonic() + 60
        while admin.get("/deployments").json() and time.monotonic() < deadline:
            time.sleep(0.5)
        proc.terminate()
        proc.wait(timeout=30)


def _ready_replica(admin: httpx.Client, name: str, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dep = admin.get(f"/deployments/{name}").json()
        ready = [r["url"] for r in dep["replica_list"] if r["state"] == "READY"]
        if ready:
            return ready[0]
        time.sleep(0.5)
    raise TimeoutError(f"deployment {name} not ready in {timeout} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    bench = {"name": "bench", "model_dir": str(tiny_model()), "replicas": 1,
             "engine_args": ENGINE_ARGS}  # fmt: skip
    with serving("gpucloud-bench-gw-", bench) as (url, key, admin):
        auth = {"Authorization": f"Bearer {key}"}
        replica = _ready_replica(admin, "bench")
        ways = {"direct": replica, "gateway": url}
        clients = [httpx.Client(headers=auth, timeout=120) for _ in range(8)]
        one = {"model": "bench", "prompt": "hello", "max_tokens": 1, "temperature": 0}
        stream = {**one, "max_tokens": 32, "stream": True, "ignore_eos": True}

        def complete(base: str, i: int) -> None:
            r = clients[i % len(clients)].post(base + "/v1/completions", json=one)
            r.raise_for_status()

        def streamed(base: str, i: int) -> None:
            with clients[0].stream("POST", base + "/v1/completions", json=stream) as r:
                r.raise_for_status()
                assert sum(1 for line in r.iter_lines() if line.startswith("data: ")) > 2

        for base in ways.values():  # warm both paths (connections, caches)
            _timed(20, 1, lambda i, b=base: complete(b, i))
        best: dict[tuple[str, str], tuple[float, list[float]]] = {}
        cases = {"1 client": (complete, 1), "8 clients": (complete, 8), "stream": (streamed, 1)}
        for _ in range(args.rounds):
            for case, (call, conc) in cases.items():
                n = args.requests if call is complete else args.requests // 4
                for way, base in ways.items():
                    wall, lat = _timed(n, conc, lambda i, c=call, b=base: c(b, i))
                    if (case, way) not in best or wall < best[case, way][0]:
                        best[case, way] = (wall, lat)
        print(f"/v1 gateway vs direct to the replica, best of {args.rounds} rounds")
        for case, (call, _) in cases.items():
            n = args.requests if call is complete else args.requests // 4
            (dw, dl), (gw, gl) = best[case, "direct"], best[case, "gateway"]
            print(
                f"  {case:<9} direct {n / dw:7.1f} req/s p50 {_p(dl, 0.5) * 1e3:6.1f} ms | "
                f"gateway {n / gw:7.1f} req/s p50 {_p(gl, 0.5) * 1e3:6.1f} ms | "
                f"throughput ratio {dw / gw:.2f}, p50 latency ratio {_p(gl, 0.5) / _p(dl, 0.5):.2f}"
            )


if __name__ == "__main__":
    main()
