"""Tensor-parallel serving: output tokens/s with the model split across 2 processes (TP2)
against one process (TP1), on the same model and workload in one run.

On a CPU the two ranks share the host's cores and memory bandwidth: each rank gets half the
threads, and every layer adds two all-reduces over loopback plus the driver's message per
step, so TP2 is expected to be slower than TP1 here. What TP buys is memory per device (each
rank holds half the heads, MLP, vocabulary and KV cache: the figures printed), which is what
lets a model larger than one GPU serve at all. Greedy outputs are checked identical (float64
would guarantee it; fp32 partial sums may round differently, so differences are counted).

    python benchmarks/serve_tp.py                  # the small preset, 32 requests
    python benchmarks/serve_tp.py --preset tiny --requests 16
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

from gpucloud.models.loader import init_model_dir
from gpucloud.serve import LLM, SamplingParams
from gpucloud.serve.tp_layers import parameter_bytes


def workload(vocab: int, count: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(32, 256))],
             rng.randint(16, 128)) for _ in range(count)]  # fmt: skip


def run(model_dir: str, reqs, tp: int, kv_cache_bytes: int):
    """(output tokens/s, outputs, per-rank (weight, KV) bytes) of one engine."""
    with LLM(model_dir, tensor_parallel_size=tp, kv_cache_bytes=kv_cache_bytes) as llm:
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in reqs]
        llm.generate([reqs[0][0]], params[0])  # warm-up: kernels, connections
        start = time.perf_counter()
        outs = llm.generate([p for p, _ in reqs], params)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if tp > 1:
            memory = llm.engine.runner.rank_memory()
        else:
            memory = [(parameter_bytes(llm.engine.model), llm.engine.runner.cache.nbytes)]
    return tokens / seconds, [o.outputs[0].token_ids for o in outs], memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-mb", type=int, default=256, help="per rank")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(init_model_dir(args.preset, f"{tmp}/{args.preset}", seed=args.seed))
        from gpucloud.models.spec import ModelSpec

        reqs = workload(ModelSpec.from_dir(model_dir).vocab_size, args.requests, args.seed)
        kv = args.kv_cache_mb << 20
        threads = torch.get_num_threads()
        one, want, memory1 = run(model_dir, reqs, 1, kv)
        two, got, memory2 = run(model_dir, reqs, 2, kv)  # each rank: threads // 2
        torch.set_num_threads(max(1, threads // 2))
        half, _, _ = run(model_dir, reqs, 1, kv)
    same = sum(g == w for g, w in zip(got, want, strict=True))
    print(f"{args.preset}: {args.requests} requests, greedy, CPU, {threads} threads")
    print(f"TP1 {one:8.1f} output tokens/s   ({threads} threads)")
    print(f"TP2 {two:8.1f} output tokens/s   ({max(1, threads // 2)} per rank)"
          f"   TP2/TP1 = {two / one:.2f}x")  # fmt: skip
    print(f"TP1 {half:8.1f} output tokens/s   ({max(1, threads // 2)} threads: one rank's share)"
          f"   TP2/this = {two / half:.2f}x")  # fmt: skip
    print(f"identical greedy outputs: {same}/{len(reqs)}")
    for name, memory in (("TP1", memory1), ("TP2", memory2)):
        for rank, (weights, cache) in enumerate(memory):
            print(f"{name} rank {rank}: weights {weights / 2**20:6.1f} MiB, KV cache "
                  f"{cache / 2**20:.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
