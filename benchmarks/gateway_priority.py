"""Priority classes on the /v1 gateway: interactive TTFT under a flood of batch requests.

A real `gpucloud server` (SQLite, 4 virtual GPUs) runs one deployment of a tiny random
Llama (`gpucloud model init --preset tiny`) with one replica. An interactive client sends
streamed completions one after the other (`--interval` seconds apart, a user reading) and
times each one's first token (TTFT), in
three phases of the same run:
  - alone: nothing else on the deployment (the baseline);
  - batch flood, prioritized: a step load of `--flood` clients looping on completions with
    a `batch`-class key (the gateway lets `--batch-in-flight` of them in per replica);
  - batch flood, unprioritized: the same flood sent with an interactive-class key, as
    every request was before priority classes.
It prints both classes' TTFT p50/p99 per phase (a batch request's TTFT includes its wait
in the gateway), the batch completions per second, and interactive p99 over alone.

    python benchmarks/gateway_priority.py [--requests 60] [--flood 32]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
from control_plane import _p
from gateway import ENGINE_ARGS, _ready_replica, serving, tiny_model

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


async def _ttft(client: httpx.AsyncClient, url: str, key: str, max_tokens: int) -> float:
    """Seconds from sending a streamed completion to its first token; reads it to the end."""
    body = {"model": "prio", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip
    start = time.perf_counter()
    first = None
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", url, json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    assert first is not None, "no token streamed"
    return first


async def _phase(url: str, interactive: str, flood_key: str | None, args) -> dict:
    """Interactive TTFTs (one request at a time) while `args.flood` clients send with
    `flood_key` (none: alone); and the flood's TTFTs and completions."""
    done = asyncio.Event()
    flood_ttft: list[float] = []
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def flood_client() -> None:
            while not done.is_set():
                flood_ttft.append(await _ttft(client, url, flood_key, args.batch_tokens))

        flood = [asyncio.create_task(flood_client()) for _ in range(args.flood if flood_key else 0)]
        if flood:
            await asyncio.sleep(args.warmup)  # the step: the flood is on before we measure
        started = time.perf_counter()
        counted = len(flood_ttft)
        ttft = []
        for _ in range(args.requests):
            ttft.append(await _ttft(client, url, interactive, 16))
            await asyncio.sleep(args.interval)
        elapsed = time.perf_counter() - started
        batch_done = len(flood_ttft) - counted
        done.set()
        await asyncio.gather(*flood)
    return {"interactive": sorted(ttft), "batch": sorted(flood_ttft), "rate": batch_done / elapsed}


def _ms(xs: list[float], q: float) -> str:
    return f"{_p(xs, q) * 1e3:7.1f}" if xs else "      -"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=60, help="interactive requests per phase")
    ap.add_argument("--flood", type=int, default=32, help="batch clients in the step load")
    ap.add_argument("--batch-tokens", type=int, default=64, help="max_tokens of a batch one")
    ap.add_argument("--batch-in-flight", type=int, default=2, help="per replica")
    ap.add_argument("--interval", type=float, default=0.2, help="interactive think time, s")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of flood before timing")
    args = ap.parse_args()
    prio = {"name": "prio", "model_dir": str(tiny_model()), "replicas": 1,
            "batch_in_flight": args.batch_in_flight, "engine_args": ENGINE_ARGS}  # fmt: skip
    with serving("gpucloud-bench-prio-", prio) as (url, key, admin):
        keys = {}
        for name, cls in (("batch", "batch"), ("flood", "interactive")):
            r = admin.post("/tenants/operator/keys", json={"name": name, "priority_class": cls})
            keys[name] = r.raise_for_status().json()["api_key"]
        _ready_replica(admin, "prio")
        v1 = url + "/v1/completions"
        asyncio.run(_phase(v1, key, None, argparse.Namespace(**{**vars(args), "requests": 5})))
        phases = {
            "alone": asyncio.run(_phase(v1, key, None, args)),
            "batch flood, prioritized": asyncio.run(_phase(v1, key, keys["batch"], args)),
            "batch flood, unprioritized": asyncio.run(_phase(v1, key, keys["flood"], args)),
        }
        alone = phases["alone"]["interactive"]
        print(
            f"TTFT (ms) of {args.requests} interactive streams, one at a time; flood: "
            f"{args.flood} clients x {args.batch_tokens} tokens, "
            f"batch_in_flight {args.batch_in_flight}"
        )
        print(f"  {'phase':<27} {'inter p50':>9} {'inter p99':>9} {'batch p50':>9} "
              f"{'batch p99':>9} {'batch/s':>7} {'p99 / alone':>11}")  # fmt: skip
        for name, r in phases.items():
            i, b = r["interactive"], r["batch"]
            print(
                f"  {name:<27} {_ms(i, 0.5):>9} {_ms(i, 0.99):>9} {_ms(b, 0.5):>9} "
                f"{_ms(b, 0.99):>9} {r['rate']:7.1f} {_p(i, 0.99) / _p(alone, 0.99):11.2f}"
            )


if __name__ == "__main__":
    main()
