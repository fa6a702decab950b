"""Priority classes on the /v1 gateway: interactive TTFT under a flood of batch requests.

A real `gpucloud server` (SQLite, 4 virtual GPUs) runs one deployment of a tiny random
Llama (`gpucloud model init --preset tiny`) with one replica. An interactive client sends
streamed completions one after the other (`--interval` seconds apart, a user reading) and
times each one's first token (TTFT). The flood runs in a process of its own (a client's
event loop busy with 32 streams would delay the interactive client's own reading of its
first token, which no real user's machine does), as a step load of `--flood` clients
looping on completions, in blocks that alternate within the same run, so the machine's
load (shared, and drifting) weighs on all of them alike:
  - alone: nothing else on the deployment (the baseline);
  - batch flood, prioritized: the flood sent with a `batch`-class key (the gateway lets
    `--batch-in-flight` of them in per replica, none while an interactive request waits
    for its first token; the engine runs them after interactive ones);
  - batch flood, unprioritized (one block at the end): the same flood sent with an
    interactive-class key, as every request was before priority classes.
It prints both classes' TTFT p50/p99 per phase (a batch request's TTFT includes its wait
in the gateway), the batch completions per second, interactive p50/p99 over alone's, and
the control plane's CPU use while timing (the gateway's own cost: its process, all threads).
`--direct` adds two phases that send the interactive requests straight to the replica
(alone, and under the same flood through the gateway), each against its own alone: the
replica's share of the slowdown, apart from the gateway's.

    python benchmarks/gateway_priority.py [--requests 120] [--rounds 4] [--flood 32]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import time

import httpx
import psutil
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


def _flood(url: str, key: str, clients: int, tokens: int, stop, out) -> None:
    """A flood process: `clients` loops of completions until `stop` is set; puts their
    TTFTs on `out`."""

    async def main() -> list[float]:
        ttfts: list[float] = []
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:

            async def one() -> None:
                while not stop.is_set():
                    ttfts.append(await _ttft(client, url, key, tokens))

            async def stopped() -> None:
                while not stop.is_set():
                    await asyncio.sleep(0.05)

            loops = [asyncio.create_task(one()) for _ in range(clients)]
            await stopped()
            await asyncio.gather(*loops)
        return ttfts

    out.put(asyncio.run(main()))


async def _interactive(url: str, key: str, n: int, interval: float) -> list[float]:
    async with httpx.AsyncClient(timeout=600) as client:
        ttft = []
        for _ in range(n):
            ttft.append(await _ttft(client, url, key, 16))
            await asyncio.sleep(interval)
        return ttft


def _server(url: str) -> psutil.Process:
    """The process listening at `url` (the control plane)."""
    port = int(url.rsplit(":", 1)[1])
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port:
            return psutil.Process(c.pid)
    raise LookupError(f"nothing listens on port {port}")


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def _block(url: str, inter_url: str, interactive: str, flood_key: str | None, n: int,
           args, server: psutil.Process) -> dict:  # fmt: skip
    """`n` interactive TTFTs (sent to `inter_url`) while the flood sends with `flood_key`
    to `url` (none: alone), and the `server`'s CPU seconds meanwhile."""
    if flood_key is None:
        started, cpu = time.perf_counter(), _cpu(server)
        ttft = asyncio.run(_interactive(inter_url, interactive, n, args.interval))
        return {"interactive": ttft, "batch": [], "done": 0,
                "seconds": time.perf_counter() - started, "cpu": _cpu(server) - cpu}  # fmt: skip
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    flood = ctx.Process(target=_flood, args=(url, flood_key, args.flood, args.batch_tokens,
                                             stop, out))  # fmt: skip
    flood.start()
    time.sleep(args.warmup)  # the step: the flood is on before we measure
    started, cpu = time.perf_counter(), _cpu(server)
    ttft = asyncio.run(_interactive(inter_url, interactive, n, args.interval))
    seconds, cpu = time.perf_counter() - started, _cpu(server) - cpu
    stop.set()
    batch = out.get()
    flood.join()
    return {"interactive": ttft, "batch": batch, "done": len(batch), "seconds": seconds,
            "cpu": cpu}  # fmt: skip


def _ms(xs: list[float], q: float) -> str:
    return f"{_p(xs, q) * 1e3:7.1f}" if xs else "      -"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=120, help="interactive requests per phase")
    ap.add_argument("--rounds", type=int, default=4, help="alone/flood blocks they split into")
    ap.add_argument("--unprioritized", type=int, default=30, help="requests of that phase")
    ap.add_argument("--flood", type=int, default=32, help="batch clients in the step load")
    ap.add_argument("--batch-tokens", type=int, default=64, help="max_tokens of a batch one")
    ap.add_argument("--batch-in-flight", type=int, default=2, help="per replica")
    ap.add_argument("--interval", type=float, default=0.2, help="interactive think time, s")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of flood before timing")
    ap.add_argument("--direct", action="store_true",
                    help="also time interactive requests sent straight to the replica (the "
                         "replica's share of the slowdown)")  # fmt: skip
    args = ap.parse_args()
    prio = {"name": "prio", "model_dir": str(tiny_model()), "replicas": 1,
            "batch_in_flight": args.batch_in_flight, "engine_args": ENGINE_ARGS}  # fmt: skip
    load = os.getloadavg()[0]
    with serving("gpucloud-bench-prio-", prio) as (url, key, admin):
        keys = {}
        for name, cls in (("batch", "batch"), ("flood", "interactive")):
            r = admin.post("/tenants/operator/keys", json={"name": name, "priority_class": cls})
            keys[name] = r.raise_for_status().json()["api_key"]
        v1 = url + "/v1/completions"
        direct = _ready_replica(admin, "prio") + "/v1/completions"
        server = _server(url)
        _block(v1, v1, key, None, 5, args, server)  # warm the paths
        kinds = [("alone", v1, None), ("batch flood, prioritized", v1, keys["batch"])]
        if args.direct:
            kinds += [("direct, alone", direct, None),
                      ("direct, batch flood", direct, keys["batch"])]  # fmt: skip
        phases = {name: {"interactive": [], "batch": [], "done": 0, "seconds": 0.0, "cpu": 0.0}
                  for name, _, _ in kinds}  # fmt: skip
        per_block = max(1, args.requests // args.rounds)
        for _ in range(args.rounds):
            for name, inter_url, flood_key in kinds:
                block = _block(v1, inter_url, key, flood_key, per_block, args, server)
                for field, value in block.items():
                    phases[name][field] += value
        if args.unprioritized:
            phases["batch flood, unprioritized"] = _block(
                v1, v1, key, keys["flood"], args.unprioritized, args, server
            )
        load = (load + os.getloadavg()[0]) / 2
    blocks = {"batch flood, prioritized": args.rounds, "direct, batch flood": args.rounds,
              "batch flood, unprioritized": 1}  # fmt: skip
    print(
        f"TTFT (ms) of interactive streams, one at a time ({per_block * args.rounds} per "
        f"phase in {args.rounds} alternating blocks); flood: {args.flood} clients x "
        f"{args.batch_tokens} tokens, batch_in_flight {args.batch_in_flight}; "
        f"load average ~{load:.1f}; gw cpu: the control plane's CPU seconds per second"
    )
    print(f"  {'phase':<27} {'inter p50':>9} {'inter p99':>9} {'batch p50':>9} "
          f"{'batch p99':>9} {'batch/s':>7} {'gw cpu':>6} {'p50/alone':>9} "
          f"{'p99/alone':>9}")  # fmt: skip
    for name, r in phases.items():
        i, b = sorted(r["interactive"]), sorted(r["batch"])
        alone = sorted(phases["direct, alone" if "direct" in name else "alone"]["interactive"])
        flooded = r["seconds"] + args.warmup * blocks.get(name, 0)  # the flood's seconds
        cpu = r["cpu"] / r["seconds"]
        rate = r["done"] / flooded if r["done"] else 0.0
        print(
            f"  {name:<27} {_ms(i, 0.5):>9} {_ms(i, 0.99):>9} {_ms(b, 0.5):>9} "
            f"{_ms(b, 0.99):>9} {rate:7.1f} {cpu:6.0%} {_p(i, 0.5) / _p(alone, 0.5):9.2f} "
            f"{_p(i, 0.99) / _p(alone, 0.99):9.2f}"
        )


if __name__ == "__main__":
    main()
