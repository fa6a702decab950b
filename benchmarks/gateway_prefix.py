"""Cache-aware routing: prefix-cache hit rate and TTFT with prompt-prefix routing against
least-in-flight alone, on a workload of shared system prompts over 2 replicas.

A real `gpucloud server` (SQLite, 4 virtual GPUs) runs one deployment of a tiny random
Llama (`gpucloud model init --preset tiny`: a token per character) with 2 replicas, each
with a KV pool of `--kv-tokens` tokens: about half of the system prompts fit in one. Every
request is one of `--systems` system prompts (`--system-chars` long) followed by a short
question, streamed, `--clients` at a time. The phases of one run, each with system prompts
of its own (so no phase finds another's in the caches):
  - least in flight: sent straight to the replicas, in the order of the gateway's balancer
    (control/routing.py) without a prefix: every replica sees every system prompt;
  - prefix routing: the same balancer given each request's prompt prefix;
  - gateway: through the control plane's /v1, which routes by prefix.
The two direct phases alternate for `--rounds` rounds. Hit rate = prompt tokens the
replicas found cached (each answer's usage.prompt_tokens_details.cached_tokens) / prompt
tokens. TTFT p50/p99 per phase, and ratios against least in flight.

    python benchmarks/gateway_prefix.py [--requests 160] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx
from control_plane import _p
from gateway import _ready_replica, serving, tiny_model

from gpucloud.control.routing import Balancer, prefix_key

BYTES_PER_TOKEN = 512  # the tiny preset's K and V (2 layers, 2 heads of 16, float32)


def _systems(tag: str, args) -> list[str]:
    rng = random.Random(tag)
    words = ["policy", "account", "card", "refund", "branch", "loan", "rate", "fee", "limit"]
    out = []
    for k in range(args.systems):
        text = f"[{tag}-{k}] You are the assistant of desk {k}. "
        while len(text) < args.system_chars:
            text += " ".join(rng.choice(words) for _ in range(8)) + ". "
        out.append(text[: args.system_chars])
    return out


async def _one(client, url: str, key: str, prompt: str) -> tuple[float, int, int]:
    """TTFT in seconds, prompt tokens and cached prompt tokens of one streamed completion."""
    body = {"model": "prefix", "prompt": prompt, "max_tokens": 4, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    first, usage = None, None
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if first is None:
                first = time.perf_counter() - start
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
    assert first is not None and usage is not None, "no token or usage streamed"
    return first, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


async def _phase(pick, key: str, systems: list[str], args) -> dict:
    """`args.requests` requests over `args.clients` clients; `pick(prompt)` gives the base
    URL and a callback for when the request is done."""
    rng = random.Random(systems[0])
    prompts = [rng.choice(systems) + f" Question {i}: what is my limit?" for i in
               range(args.requests)]  # fmt: skip
    results: list[tuple[float, int, int]] = []
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker(mine: list[str]) -> None:
            for prompt in mine:
                url, done = pick(prompt)
                try:
                    results.append(await _one(client, url, key, prompt))
                finally:
                    done()

        await asyncio.gather(*(worker(prompts[c :: args.clients]) for c in range(args.clients)))
    ttft = sorted(r[0] for r in results)
    return {"ttft": ttft, "hit": sum(r[2] for r in results) / sum(r[1] for r in results)}


def _direct(replicas: list[tuple[int, str]], by_prefix: bool):
    balancer = Balancer()

    def pick(prompt: str):
        prefix = prefix_key({"prompt": prompt}) if by_prefix else None
        rid, url = balancer.order(replicas, prefix)[0]
        balancer.in_flight[rid] += 1
        return url, lambda: balancer.in_flight.__setitem__(rid, balancer.in_flight[rid] - 1)

    return pick


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=160, help="per phase")
    ap.add_argument("--rounds", type=int, default=2, help="of the two direct phases")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--systems", type=int, default=8, help="system prompts per phase")
    ap.add_argument("--system-chars", type=int, default=900)
    ap.add_argument("--kv-tokens", type=int, default=6144, help="KV pool of a replica")
    args = ap.parse_args()
    engine = ["--kv-cache-bytes", str(args.kv_tokens * BYTES_PER_TOKEN), "--log-level", "warning"]
    spec = {"name": "prefix", "model_dir": str(tiny_model()), "replicas": 2,
            "engine_args": engine}  # fmt: skip
    with serving("gpucloud-bench-prefix-", spec) as (url, key, admin):
        _ready_replica(admin, "prefix")
        deadline = time.monotonic() + 600
        while (dep := admin.get("/deployments/prefix").json())["ready_replicas"] < 2:
            assert time.monotonic() < deadline, "the second replica did not start"
            time.sleep(0.5)
        replicas = [(r["id"], r["url"]) for r in dep["replica_list"]]
        warm = argparse.Namespace(**{**vars(args), "requests": 8})
        asyncio.run(_phase(_direct(replicas, False), key, _systems("warm", args), warm))
        phases: dict[str, list[dict]] = {"least in flight": [], "prefix routing": []}
        for r in range(args.rounds):
            for name in phases:
                pick = _direct(replicas, name == "prefix routing")
                phases[name].append(asyncio.run(_phase(pick, key, _systems(f"{name}{r}", args),
                                                       args)))  # fmt: skip
        gateway = asyncio.run(_phase(lambda p: (url, lambda: None), key,
                                     _systems("gateway", args), args))  # fmt: skip
    print(
        f"{args.requests} streamed completions per phase, {args.clients} clients, "
        f"{args.systems} system prompts of {args.system_chars} tokens, 2 replicas of "
        f"{args.kv_tokens} KV tokens"
    )
    print(f"  {'phase':<22} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'p50 / LIF':>9} {'p99 / LIF':>9}")  # fmt: skip
    rows = [(f"{name} #{i + 1}", r, phases["least in flight"][i]) for name, runs in
            phases.items() for i, r in enumerate(runs)]  # fmt: skip
    rows.append(("gateway (prefix)", gateway, phases["least in flight"][-1]))
    for name, r, base in rows:
        t, b = r["ttft"], base["ttft"]
        print(
            f"  {name:<22} {r['hit']:8.1%} {_p(t, 0.5) * 1e3:7.1f}ms {_p(t, 0.99) * 1e3:7.1f}ms "
            f"{_p(t, 0.5) / _p(b, 0.5):9.2f} {_p(t, 0.99) / _p(b, 0.99):9.2f}"
        )


if __name__ == "__main__":
    main()
