"""Online serving: `gpucloud serve` under Poisson arrivals against the offline engine.

Seeded workloads (random token prompts and output lengths, EOS ignored, greedy) run
against a real `gpucloud serve` process over HTTP with streaming, at several request rates
(fresh prompts per rate, so the prefix cache never helps). Per rate it prints request
throughput, output tokens/s, time to first token and time per output token (p50/p99). The
last rate, `inf`, sends everything at once: that is saturation, where the server's output
tokens/s should be >= 90% of the offline engine's (`gpucloud.serve.LLM` in this process,
every request known up front) on the same workload, measured right before and right after.

    python benchmarks/serve_online.py                    # small preset, 48 requests per rate
    python benchmarks/serve_online.py --rates 2,8,inf --requests 200
"""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning. On a shared or oversubscribed CPU, spinning
# workers slow an engine stepped from the main thread (the offline run) several times more
# than one stepped from a worker thread (the server), which would flatter the server. Set
# before torch loads, and inherited by the server process, so both run alike.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from gpucloud.models.loader import init_model_dir
from gpucloud.serve import LLM, SamplingParams

KV_CACHE_BYTES = 256 << 20


@dataclass
class Request:
    prompt: list[int]
    output_len: int


@dataclass
class Result:
    sent: float
    first: float
    done: float
    tokens: int


def workload(count: int, vocab: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            [rng.randrange(3, vocab) for _ in range(rng.randint(32, 512))], rng.randint(32, 256)
        )  # fmt: skip
        for _ in range(count)
    ]


def engine_flags(args) -> dict:
    return {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_batched_tokens,
            "kv_cache_bytes": KV_CACHE_BYTES}  # fmt: skip


def run_offline(model_dir: Path, reqs: list[Request], args) -> float:
    llm = LLM(model_dir, **engine_flags(args))
    params = [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True) for r in reqs]
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    start = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def start_server(model_dir: Path, args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_flags(args).items()]
    cli = [sys.executable, "-c", "from gpucloud.cli.main import app; app()"]
    proc = subprocess.Popen([*cli, "serve", str(model_dir), f"--port={port}", "--log-level=warning",
                             *flags], stdout=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become ready")


async def one(client: httpx.AsyncClient, model: str, req: Request, delay: float) -> Result:
    await asyncio.sleep(delay)
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = None
    last = ""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                first = first or time.perf_counter()
                last = line
    usage = json.loads(last[len("data: ") :])["usage"]
    return Result(
        sent, first or time.perf_counter(), time.perf_counter(), usage["completion_tokens"]
    )


async def run_rate(url: str, model: str, reqs: list[Request], rate: float, seed: int):
    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in reqs:
        delays.append(t)
        t += rng.expovariate(rate) if rate != float("inf") else 0.0
    limits = httpx.Limits(max_connections=len(reqs), max_keepalive_connections=len(reqs))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        pending = [one(client, model, r, d) for r, d in zip(reqs, delays, strict=True)]
        results = await asyncio.gather(*pending)
    end = max(r.done for r in results)
    return results, end - start


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--requests", type=int, default=48, help="requests per rate")
    parser.add_argument("--rates", default="0.5,1,inf", help="requests/s; the last is saturation")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-batched-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_model_dir(args.preset, Path(tmp) / args.preset, seed=0)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        # Fresh prompts for every rate: the server's prefix cache must not remember a run.
        runs = [workload(args.requests, vocab, args.seed + i) for i in range(len(rates))]
        print(f"{args.requests} requests per rate (prompts 32-512 tokens, outputs 32-256), "
              f"preset {args.preset}, max_num_seqs {args.max_num_seqs}")  # fmt: skip
        proc, url = start_server(model_dir, args)
        try:
            warm = workload(4, vocab, args.seed - 1)
            asyncio.run(run_rate(url, model_dir.name, warm, float("inf"), 0))
            columns = ["rate req/s", "req/s", "out tok/s", "TTFT p50", "TTFT p99"]
            print(" ".join(f"{c:>10}" for c in [*columns, "TPOT p50", "TPOT p99"]), flush=True)
            for i, (rate, reqs) in enumerate(zip(rates, runs, strict=True)):
                if i == len(rates) - 1:  # the offline baseline, right before saturation
                    before = run_offline(model_dir, reqs, args)
                cpu = time.process_time()
                results, elapsed = asyncio.run(run_rate(url, model_dir.name, reqs, rate, i))
                cpu = time.process_time() - cpu
                assert sum(r.tokens for r in results) == sum(r.output_len for r in reqs)
                print(row(rate, results, elapsed), flush=True)
            online = sum(r.tokens for r in results) / elapsed
        finally:
            proc.terminate()
            proc.wait(60)
        after = run_offline(model_dir, reqs, args)  # and right after it, with the server gone
        offline = (before + after) / 2
        print(f"offline engine on the rate-{rates[-1]:g} workload: {before:.0f} output tok/s "
              f"before, {after:.0f} after; the server at rate {rates[-1]:g}: {online:.0f} "
              f"output tok/s = {online / offline:.0%} of offline (this client's CPU meanwhile: "
              f"{cpu / (online * elapsed) * 1e6:.0f} us per output token)")  # fmt: skip


def row(rate: float, results: list[Result], elapsed: float) -> str:
    ttft = [r.first - r.sent for r in results]
    tpot = [(r.done - r.first) / max(r.tokens - 1, 1) for r in results]
    tokens = sum(r.tokens for r in results)
    cells = [f"{rate:g}", f"{len(results) / elapsed:.2f}", f"{tokens / elapsed:.0f}"]
    cells += [f"{pct(ttft, 0.5) * 1e3:.0f} ms", f"{pct(ttft, 0.99) * 1e3:.0f} ms"]
    cells += [f"{pct(tpot, 0.5) * 1e3:.1f} ms", f"{pct(tpot, 0.99) * 1e3:.1f} ms"]
    return " ".join(f"{c:>10}" for c in cells)


if __name__ == "__main__":
    main()
