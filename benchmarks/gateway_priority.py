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
replica's share of the slowdown, apart from the gateway's. A second table splits the
gateway phases' TTFT: to the response headers (of which the gateway's admission and its
way to the replica's headers, from its Server-Timing header), then to the first token (of
which the replica's first event and its relay, from the gateway's phase histogram), for
all requests (p50/p99) and for the slowest 1% (means). 300 requests a phase: p99 is the
3rd-worst, not one request.

    python benchmarks/gateway_priority.py [--requests 300] [--rounds 6] [--flood 32]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import os
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import psutil
from control_plane import _p
from gateway import ENGINE_ARGS, _ready_replica, serving, tiny_model
from prometheus_client.parser import text_string_to_metric_families

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
GATEWAY_PHASES = ("admit", "upstream", "first_chunk", "first_write")


@dataclass(frozen=True, slots=True)
class Sample:
    """One streamed completion, in seconds from its sending."""

    ttft: float
    headers: float  # its response headers came
    gateway: dict[str, float]  # the phases in the gateway's Server-Timing header, if any


async def _sample(client: httpx.AsyncClient, url: str, key: str, max_tokens: int) -> Sample:
    """A streamed completion, timed to its headers and its first token; read to the end."""
    body = {"model": "prio", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip
    start = time.perf_counter()
    first = None
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", url, json=body, headers=headers) as r:
        at_headers = time.perf_counter() - start
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    assert first is not None, "no token streamed"
    return Sample(first, at_headers, _server_timing(r.headers.get("server-timing", "")))


def _server_timing(header: str) -> dict[str, float]:
    """`admit;dur=0.41, upstream;dur=2.30` as {"admit": 0.00041, "upstream": 0.0023}."""
    phases = {}
    for entry in filter(None, header.split(",")):
        name, _, dur = entry.strip().partition(";dur=")
        phases[name] = float(dur) / 1e3
    return phases


def _flood(url: str, key: str, clients: int, tokens: int, stop, out) -> None:
    """A flood process: `clients` loops of completions until `stop` is set; puts their
    TTFTs on `out`."""

    async def main() -> list[float]:
        ttfts: list[float] = []
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:

            async def one() -> None:
                while not stop.is_set():
                    ttfts.append((await _sample(client, url, key, tokens)).ttft)

            async def stopped() -> None:
                while not stop.is_set():
                    await asyncio.sleep(0.05)

            loops = [asyncio.create_task(one()) for _ in range(clients)]
            await stopped()
            await asyncio.gather(*loops)
        return ttfts

    out.put(asyncio.run(main()))


async def _interactive(url: str, key: str, n: int, interval: float) -> list[Sample]:
    """`n` timed requests after an untimed one: a block's client starts as a user already
    using the deployment does (its connection open, its key's route in the gateway's
    memory), or the first request of every block (2% of them) is what p99 measures."""
    async with httpx.AsyncClient(timeout=600) as client:
        await _sample(client, url, key, 16)
        await asyncio.sleep(interval)
        samples = []
        for _ in range(n):
            samples.append(await _sample(client, url, key, 16))
            await asyncio.sleep(interval)
        return samples


def _phase_buckets(url: str) -> dict[str, Counter]:
    """The gateway's phase histogram of interactive requests: {phase: {le: count}}."""
    text = httpx.get(url + "/metrics", timeout=30).text
    buckets: dict[str, Counter] = {phase: Counter() for phase in GATEWAY_PHASES}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if (s.name == "gpucloud_gateway_phase_seconds_bucket"
                    and s.labels["priority_class"] == "interactive"):  # fmt: skip
                buckets[s.labels["phase"]][float(s.labels["le"])] += s.value
    return buckets


def _histogram_quantile(buckets: Counter, q: float) -> float:
    """The `q` quantile of cumulative `buckets` {le: count}, interpolated within its bucket."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    below, lower = 0.0, 0.0
    for le in bounds:
        if buckets[le] >= q * total:
            if math.isinf(le):
                return lower
            share = (q * total - below) / max(buckets[le] - below, 1e-9)
            return lower + (le - lower) * share
        below, lower = buckets[le], le
    return lower


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
    """`n` interactive requests (sent to `inter_url`) while the flood sends with `flood_key`
    to `url` (none: alone), the `server`'s CPU seconds meanwhile, and what its gateway's
    phase histogram of interactive requests gained."""
    base = url.removesuffix("/v1/completions")
    buckets = _phase_buckets(base)
    if flood_key is None:
        started, cpu = time.perf_counter(), _cpu(server)
        samples = asyncio.run(_interactive(inter_url, interactive, n, args.interval))
        return {"interactive": samples, "batch": [], "done": 0,
                "seconds": time.perf_counter() - started, "cpu": _cpu(server) - cpu,
                "buckets": _gained(buckets, _phase_buckets(base))}  # fmt: skip
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    flood = ctx.Process(target=_flood, args=(url, flood_key, args.flood, args.batch_tokens,
                                             stop, out))  # fmt: skip
    flood.start()
    time.sleep(args.warmup)  # the step: the flood is on before we measure
    started, cpu, buckets = time.perf_counter(), _cpu(server), _phase_buckets(base)
    samples = asyncio.run(_interactive(inter_url, interactive, n, args.interval))
    seconds, cpu = time.perf_counter() - started, _cpu(server) - cpu
    gained = _gained(buckets, _phase_buckets(base))
    stop.set()
    batch = out.get()
    flood.join()
    return {"interactive": samples, "batch": batch, "done": len(batch), "seconds": seconds,
            "cpu": cpu, "buckets": gained}  # fmt: skip


def _gained(before: dict[str, Counter], after: dict[str, Counter]) -> dict[str, Counter]:
    return {phase: after[phase] - before[phase] for phase in after}


def _ms(xs: list[float], q: float) -> str:
    return f"{_p(xs, q) * 1e3:7.1f}" if xs else "      -"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300, help="interactive requests per phase")
    ap.add_argument("--rounds", type=int, default=6, help="alone/flood blocks they split into")
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
        phases = {name: {"interactive": [], "batch": [], "done": 0, "seconds": 0.0, "cpu": 0.0,
                         "buckets": {}} for name, _, _ in kinds}  # fmt: skip
        per_block = max(1, args.requests // args.rounds)
        for _ in range(args.rounds):
            for name, inter_url, flood_key in kinds:
                block = _block(v1, inter_url, key, flood_key, per_block, args, server)
                for field, value in block.items():
                    if field == "buckets":
                        for phase, counts in value.items():
                            phases[name][field].setdefault(phase, Counter()).update(counts)
                    else:
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
        i = sorted(x.ttft for x in r["interactive"])
        b = sorted(r["batch"])
        baseline = phases["direct, alone" if "direct" in name else "alone"]["interactive"]
        alone = sorted(x.ttft for x in baseline)
        flooded = r["seconds"] + args.warmup * blocks.get(name, 0)  # the flood's seconds
        cpu = r["cpu"] / r["seconds"]
        rate = r["done"] / flooded if r["done"] else 0.0
        print(
            f"  {name:<27} {_ms(i, 0.5):>9} {_ms(i, 0.99):>9} {_ms(b, 0.5):>9} "
            f"{_ms(b, 0.99):>9} {rate:7.1f} {cpu:6.0%} {_p(i, 0.5) / _p(alone, 0.5):9.2f} "
            f"{_p(i, 0.99) / _p(alone, 0.99):9.2f}"
        )
    _print_breakdown({name: r for name, r in phases.items() if "direct" not in name})


def _print_breakdown(phases: dict[str, dict]) -> None:
    """Where the interactive requests' TTFT went through the gateway: to the response's
    headers (client's clock), of which admission and the way to the replica's headers
    (the gateway's Server-Timing), then to the first token (client's clock), of which the
    replica's first event and its relay (the gateway's histograms: bucket-interpolated);
    and the same means over the slowest 1%, whose share is what moves p99."""
    print("Interactive TTFT through the gateway, by phase (ms, p50/p99); hist: from "
          "gpucloud_gateway_phase_seconds, interpolated in its buckets")  # fmt: skip
    columns = ("to headers", "admit", "upstream", "after hdrs", "first_chunk", "first_write")
    print(f"  {'phase':<27} " + " ".join(f"{c:>13}" for c in columns))
    for name, r in phases.items():
        samples = r["interactive"]
        parts = {"to headers": [x.headers for x in samples],
                 "admit": [x.gateway.get("admit", 0.0) for x in samples],
                 "upstream": [x.gateway.get("upstream", 0.0) for x in samples],
                 "after hdrs": [x.ttft - x.headers for x in samples]}  # fmt: skip
        cells = [f"{_ms(sorted(v), 0.5).strip()}/{_ms(sorted(v), 0.99).strip()}"
                 for v in parts.values()]  # fmt: skip
        for phase in ("first_chunk", "first_write"):
            buckets = r["buckets"].get(phase)
            if not buckets or not max(buckets.values()):
                cells.append("-")
                continue
            p50, p99 = (_histogram_quantile(buckets, q) * 1e3 for q in (0.5, 0.99))
            cells.append(f"{p50:.1f}/{p99:.1f} hist")
        print(f"  {name:<27} " + " ".join(f"{c:>13}" for c in cells))
        slow = sorted(samples, key=lambda x: x.ttft)[int(0.99 * len(samples)) :]
        means = [sum(x.headers for x in slow),
                 sum(x.gateway.get("admit", 0.0) for x in slow),
                 sum(x.gateway.get("upstream", 0.0) for x in slow),
                 sum(x.ttft - x.headers for x in slow)]  # fmt: skip
        cells = [f"{m / len(slow) * 1e3:.1f}" for m in means]
        print(f"  {'  slowest 1%, mean':<27} " + " ".join(f"{c:>13}" for c in cells))


if __name__ == "__main__":
    main()
