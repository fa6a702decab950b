"""Canary split accuracy: the share of requests a canary gets through the /v1 gateway,
observed against the share requested.

A real `gpucloud server` (SQLite) runs one replica of a tiny random Llama; for each
requested share, `gpucloud deploy rollout` starts a second version (the same model, one
replica) beside it, the script sends N completions (from 4 clients at once) with no
`user` (spread by request), then N completions each from a different `user` (each user
sticks to one version), counts the answers each version's replica gave (its own
/metrics), and rolls the canary back. The baseline is what a fair coin per request would
give: its standard error sqrt(p (1 - p) / N), against which the observed error reads.

    python benchmarks/gateway_canary.py [--requests 400] [--shares 10 30]
"""

from __future__ import annotations

import argparse
import math
import time

import httpx
from control_plane import _timed
from gateway import ENGINE_ARGS, serving, tiny_model
from prometheus_client.parser import text_string_to_metric_families


def _answered(replica_url: str) -> float:
    text = httpx.get(replica_url + "/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "gpucloud_serve_request_success_total"
    )


def _replicas_by_version(admin: httpx.Client, numbers: set[int]) -> dict[int, str]:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        reps = admin.get("/deployments/split").json()["replica_list"]
        urls = {r["version"]: r["url"] for r in reps if r["state"] == "READY"}
        if set(urls) == numbers:
            return urls
        time.sleep(0.2)
    raise TimeoutError(f"versions {numbers} not ready")


def _shares(url: str, key: str, urls: dict[int, str], canary: int, n: int, users: bool) -> float:
    """The canary's observed share of `n` completions."""
    clients = [httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=120)
               for _ in range(4)]  # fmt: skip

    def complete(i: int) -> None:
        body = {"model": "split", "prompt": "hi", "max_tokens": 1}
        if users:
            body["user"] = f"user-{i}"
        clients[i % 4].post(url + "/v1/completions", json=body).raise_for_status()

    before = {v: _answered(u) for v, u in urls.items()}
    _timed(n, 4, complete)
    got = {v: _answered(u) - before[v] for v, u in urls.items()}
    return got[canary] / sum(got.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--shares", type=float, nargs="+", default=[10.0, 30.0])
    args = ap.parse_args()
    split = {"name": "split", "model_dir": str(tiny_model()), "replicas": 1,
             "engine_args": ENGINE_ARGS}  # fmt: skip
    with serving("gpucloud-bench-canary-", split) as (url, key, admin):
        n = args.requests
        print(f"canary share of {n} completions through the /v1 gateway")
        for share in args.shares:
            rollout = {"model_dir": split["model_dir"], "engine_args": ENGINE_ARGS,
                       "canary": share, "guard": None}  # fmt: skip
            canary = admin.post("/deployments/split/rollout", json=rollout).json()["canary"]
            urls = _replicas_by_version(admin, {1, canary["number"]})
            time.sleep(1.5)  # the gateway's routes (kept 1 s) show the canary's replica
            p = share / 100
            coin = math.sqrt(p * (1 - p) / n)
            by_request = _shares(url, key, urls, canary["number"], n, users=False)
            by_user = _shares(url, key, urls, canary["number"], n, users=True)
            print(
                f"  requested {share:5.1f}% | by request {by_request:6.1%} "
                f"(error {abs(by_request - p) * 100:.2f} pt) | {n} users {by_user:6.1%} "
                f"(error {abs(by_user - p) * 100:.2f} pt) | coin per request: "
                f"std error {coin * 100:.2f} pt"
            )
            admin.post("/deployments/split/rollback").raise_for_status()


if __name__ == "__main__":
    main()
