"""Scale to zero and back: how long the first request to an idle deployment takes, split,
and what a warm pool saves.

A real `gpucloud server` (SQLite) runs two deployments of a tiny random Llama with
min_replicas 0: `lazy`, and `pooled` with a warm pool of one replica (loaded, not routed).
Each round waits until neither routes a replica, sends each one streamed completion through
the /v1 gateway, and splits `lazy`'s time to first token with the times its replica's
`gpucloud serve` reports on /ready:
  - scale-up: from the request to its replica's process start (the gateway's wait is seen
    by the autoscaler, which resizes; the reconciler places and launches the process);
  - process start -> weights loaded: interpreter, imports, weight load, KV pool;
  - weights loaded -> ready: the HTTP server's start;
  - ready -> first token: the control plane's probe finds /ready answering, the gateway's
    next look at the routes, then the first token.
`pooled` only waits for the autoscaler to promote its warm replica and the gateway to see
it. The baseline is the same request while a replica is routed (warm).

    python benchmarks/gateway_cold_start.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx
from gateway import ENGINE_ARGS, serving, tiny_model

PHASES = ("scale-up", "start->weights", "weights->ready", "ready->token", "cold TTFT")


def _first_token(url: str, key: str, model: str) -> tuple[float, float]:
    """(wall clock when sent, seconds to the first streamed token)."""
    body = {"model": model, "prompt": "hello", "max_tokens": 4, "stream": True}
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


def _startup(admin: httpx.Client, name: str) -> dict[str, float]:
    """The start phases its routed replica reports (Unix times), read before it scales away."""
    replica = next(r for r in _replicas(admin, name) if r["state"] == "READY")
    return httpx.get(replica["url"] + "/ready", timeout=30).json()["startup"]


def _replicas(admin: httpx.Client, name: str) -> list[dict]:
    return admin.get(f"/deployments/{name}").json()["replica_list"]


def _idle(admin: httpx.Client, name: str, warm: int) -> bool:
    """No replica routed, and `warm` loaded in the pool."""
    states = [r["state"] for r in _replicas(admin, name)]
    return states.count("WARM") == warm == len(states)


def _until(predicate, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(predicate)
        time.sleep(0.2)


def _split(sent: float, ttft: float, up: dict[str, float]) -> tuple[float, ...]:
    token = sent + ttft
    return (up["process_started"] - sent, up["weights_loaded"] - up["process_started"],
            up["ready"] - up["weights_loaded"], token - up["ready"], ttft)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = str(tiny_model())
    autoscale = {"min_replicas": 0, "max_replicas": 1, "scale_down_delay": 3,
                 "max_cold_wait": 600}  # fmt: skip
    lazy = {"name": "lazy", "model_dir": model, "replicas": 0, "autoscale": autoscale,
            "engine_args": ENGINE_ARGS}  # fmt: skip
    pooled = {**lazy, "name": "pooled", "warm_pool": 1}
    with serving("gpucloud-bench-cold-", lazy) as (url, key, admin):
        admin.post("/deployments", json=pooled).raise_for_status()
        try:
            _first_token(url, key, "lazy")  # the first start on a machine compiles kernels
            splits, pool, warm = [], [], []
            for _ in range(args.rounds):
                _until(lambda: _idle(admin, "lazy", 0) and _idle(admin, "pooled", 1))
                sent, ttft = _first_token(url, key, "lazy")
                splits.append(_split(sent, ttft, _startup(admin, "lazy")))
                pool.append(_first_token(url, key, "pooled")[1])
                warm.append(_first_token(url, key, "lazy")[1])
            _report(args.rounds, splits, pool, warm)
        finally:
            admin.delete("/deployments/pooled")


def _report(rounds: int, splits: list, pool: list[float], warm: list[float]) -> None:
    print(f"cold start through the gateway, median of {rounds} rounds (s)")
    for i, name in enumerate(PHASES):
        print(f"  {name:<15} {statistics.median(s[i] for s in splits):7.2f}")
    w, c, p = (statistics.median(x) for x in (warm, [s[-1] for s in splits], pool))
    print(f"  warm-pool TTFT  {p:7.2f}   cold / warm pool {c / p:.1f}x")
    print(f"  warm TTFT       {w:7.3f}   cold / warm {c / w:.0f}x   warm pool / warm {p / w:.0f}x")


if __name__ == "__main__":
    main()
