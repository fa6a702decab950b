"""Scale to zero and back: how long the first request to an idle deployment takes, split.

A real `gpucloud server` (SQLite) runs a deployment of a tiny random Llama with
min_replicas 0. Each round waits until it has no replica left, sends one streamed
completion through the /v1 gateway, and splits the time to its first token into
  - scale-up: from the request to the replica's process start (the gateway's wait is
    seen by the autoscaler, which resizes; the reconciler places and launches it);
  - process start to READY: interpreter, imports, weight load and warm-up, until the
    control plane's probe finds /ready answering;
  - READY to first token: the gateway's next look at the routes, then the first token.
The baseline is the same request to the deployment while its replica is warm.

    python benchmarks/gateway_cold_start.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx
from gateway import ENGINE_ARGS, serving, tiny_model


def _first_token(url: str, key: str) -> tuple[float, float]:
    """(wall clock when sent, seconds to the first streamed token)."""
    body = {"model": "lazy", "prompt": "hello", "max_tokens": 4, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    sent = time.time()
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers,
                      timeout=600) as r:  # fmt: skip
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return sent, time.perf_counter() - start
    raise AssertionError("no token streamed")


def _replica_times(admin: httpx.Client) -> tuple[float, float]:
    """(started_at, ready_at) of the deployment's replica, read before it scales away."""
    replica = admin.get("/deployments/lazy").json()["replica_list"][0]
    return replica["started_at"], replica["ready_at"]


def _until(predicate, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(predicate)
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    lazy = {"name": "lazy", "model_dir": str(tiny_model()), "replicas": 0,
            "autoscale": {"min_replicas": 0, "max_replicas": 1, "scale_down_delay": 3,
                          "max_cold_wait": 600},
            "engine_args": ENGINE_ARGS}  # fmt: skip
    with serving("gpucloud-bench-cold-", lazy) as (url, key, admin):
        _first_token(url, key)  # the first start on a machine also compiles kernels
        splits, warm = [], []
        for _ in range(args.rounds):
            _until(lambda: admin.get("/deployments/lazy").json()["replica_list"] == [])
            sent, ttft = _first_token(url, key)
            started, ready = _replica_times(admin)
            warm.append(_first_token(url, key)[1])
            splits.append((started - sent, ready - started, ttft - (ready - sent), ttft))
        print(f"cold start through the gateway, median of {args.rounds} rounds (s)")
        names = ("scale-up", "start->READY", "READY->token", "cold TTFT")
        for i, name in enumerate(names):
            print(f"  {name:<13} {statistics.median(s[i] for s in splits):7.2f}")
        w, c = statistics.median(warm), statistics.median(s[3] for s in splits)
        print(f"  warm TTFT     {w:7.3f}   cold / warm {c / w:.0f}x")


if __name__ == "__main__":
    main()
