"""Offline serving throughput: gpucloud's engine against transformers, on the same model.

A seeded workload (random prompts of random length, random output lengths, EOS ignored,
greedy) runs through `gpucloud.serve.LLM`, then through transformers' `generate` one request
at a time and with padded static batches. The script also measures this machine's matmul
FLOP/s and memory bandwidth and prints the workload's roofline: the output tokens/s no
engine can beat here, given the FLOPs the workload needs and the weights each step reads.

    python benchmarks/serve_offline.py                       # the issue's workload (200 requests)
    python benchmarks/serve_offline.py --workload peers      # the workload of the vLLM figure
    python benchmarks/serve_offline.py --profile             # where a step's time goes, only
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass

import step_profile
import torch

from gpucloud.models.loader import init_model_dir, load_model
from gpucloud.models.spec import ModelSpec
from gpucloud.serve import LLM, SamplingParams

WORKLOADS = {  # requests, prompt length range, output length range
    "issue": (200, (32, 1024), (16, 512)),
    "peers": (64, (32, 512), (16, 256)),
}


@dataclass
class Timing:
    """Wall seconds, and this process's CPU seconds per thread: the wall time the same work
    takes on an idle machine. These machines are shared; the second figure is the stable one."""

    wall: float
    cpu: float

    def rates(self, amount: float) -> tuple[float, float]:
        return amount / self.wall, amount / self.cpu


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    threads = torch.get_num_threads()
    return result, Timing(time.perf_counter() - wall, (time.process_time() - cpu) / threads)


@dataclass
class Request:
    prompt: list[int]
    output_len: int


def make_workload(name: str, vocab: int, seed: int) -> list[Request]:
    count, (p_lo, p_hi), (o_lo, o_hi) = WORKLOADS[name]
    rng = random.Random(seed)
    return [
        Request(
            [rng.randrange(3, vocab) for _ in range(rng.randint(p_lo, p_hi))],
            rng.randint(o_lo, o_hi),
        )
        for _ in range(count)
    ]


def run_gpucloud(model_dir: str, reqs: list[Request], args) -> tuple[Timing, object]:
    llm, run = gpucloud_workload(model_dir, reqs, args)
    outs, timing = timed(run)
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(r.output_len for r in reqs)
    return timing, llm.engine.stats()


def profile_gpucloud(model_dir: str, reqs: list[Request], args) -> None:
    llm, run = gpucloud_workload(model_dir, reqs, args)
    rows = step_profile.profile(run)
    step_profile.print_profile(rows, llm.engine.stats().num_steps, torch.get_num_threads())


def gpucloud_workload(model_dir: str, reqs: list[Request], args):
    """The engine, warmed up, and the call that runs the workload through it."""
    llm = LLM(
        model_dir,
        dtype="float32",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=True,
    )
    params = [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True) for r in reqs]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    return llm, lambda: llm.generate([r.prompt for r in reqs], params)


def hf_model(model_dir: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def run_hf_static(hf, reqs: list[Request], batch: int) -> Timing:
    """Padded static batches: each batch runs until its longest output is done."""
    return timed(lambda: _hf_batches(hf, reqs, batch))[1]


def _hf_batches(hf, reqs: list[Request], batch: int) -> None:
    for i in range(0, len(reqs), batch):
        group = reqs[i : i + batch]
        width = max(len(r.prompt) for r in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(group):  # left padding, as decoder-only batching needs
            ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt) :] = 1
        longest = max(r.output_len for r in group)
        hf.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                    do_sample=False, pad_token_id=0)  # fmt: skip


def measure_machine() -> tuple[float, float]:
    """Matmul FLOP/s (fp32, large square) and memory bandwidth (bytes/s read + written),
    best of a few runs, in CPU time per thread (what an idle machine does)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    flops = 2 * 2048**3 / _best(lambda: a @ b, 5)
    x = torch.empty(64 * 2**20)  # 256 MB, far beyond the caches
    y = torch.empty_like(x)
    bandwidth = 2 * x.numel() * 4 / _best(lambda: y.copy_(x), 5)
    return flops, bandwidth


def _best(fn, repeats: int) -> float:
    fn()
    return min(timed(fn)[1].cpu for _ in range(repeats))


def roofline(spec: ModelSpec, reqs: list[Request], max_num_seqs: int, flops: float, bw: float):
    """Output tokens/s bound for this workload: the FLOPs it needs at the measured matmul rate,
    or the weight reads its decode steps need at the measured bandwidth, whichever is slower.
    Logits are needed only for the last prompt token and each generated token."""
    head = spec.vocab_size * spec.hidden_size
    body = spec.num_params - spec.embedding_params - spec.lm_head_params
    attn = 2 * spec.num_hidden_layers * spec.q_size  # per (query, key) pair: QK and PV
    total = 0.0
    for r in reqs:
        p = len(r.prompt)
        total += 2 * body * p + attn * p * (p + 1) / 2 + 2 * head
        total += r.output_len * (2 * (body + head)) + attn * r.output_len * (p + r.output_len / 2)
    compute_time = total / flops
    steps = max(
        max(r.output_len for r in reqs), -(-sum(r.output_len for r in reqs) // max_num_seqs)
    )
    weight_bytes = 4 * (body + head)
    memory_time = steps * weight_bytes / bw
    out = sum(r.output_len for r in reqs)
    return out / max(compute_time, memory_time), out / compute_time, out / memory_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=WORKLOADS, default="issue")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="torch threads; 1 gives steady per-core figures on a busy machine",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--static-batch", type=int, default=16)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="only gpucloud, under cProfile: where a step's time goes",
    )
    parser.add_argument(
        "--baseline-requests",
        type=int,
        default=32,
        help="transformers runs on this many of the requests (it is slow)",
    )
    parser.add_argument(
        "--single-requests",
        type=int,
        default=4,
        help="requests for the one-at-a-time transformers baseline",
    )
    args = parser.parse_args()  # fmt: skip
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(init_model_dir(args.preset, tmp, seed=args.seed))
        spec = load_model(model_dir).spec
        reqs = make_workload(args.workload, spec.vocab_size, args.seed)
        n_out = sum(r.output_len for r in reqs)
        print(f"model {args.preset}: {spec.num_params / 1e6:.1f}M params, fp32, "
              f"{torch.get_num_threads()} threads")  # fmt: skip
        n_in = sum(len(r.prompt) for r in reqs)
        print(f"workload {args.workload}: {len(reqs)} requests, {n_in} prompt tokens, "
              f"{n_out} output tokens")  # fmt: skip
        if args.profile:
            profile_gpucloud(model_dir, reqs, args)
            return
        ours, stats = run_gpucloud(model_dir, reqs, args)
        report("gpucloud LLM", ours, n_out, f"steps {stats.num_steps}, "
               f"preemptions {stats.num_preemptions}")  # fmt: skip
        pool = stats.num_blocks * stats.block_size
        mean_len = (n_in + n_out) / len(reqs)
        print(f"KV pool: {pool} tokens at {stats.kv_bytes_per_token} B/token "
              f"({pool * stats.kv_bytes_per_token / 2**20:.0f} MiB), holds "
              f"{pool // mean_len:.0f} sequences of this workload's mean length "
              f"{mean_len:.0f}, {pool // spec.max_position_embeddings} of full context"
              )  # fmt: skip
        hf = hf_model(model_dir)
        sub = reqs[: args.baseline_requests]
        static = run_hf_static(hf, sub, args.static_batch)
        report(f"transformers static/{args.static_batch}", static,
               sum(r.output_len for r in sub), f"first {len(sub)} requests")  # fmt: skip
        ones = reqs[: args.single_requests]
        single = run_hf_static(hf, ones, 1)
        report("transformers 1-at-once", single, sum(r.output_len for r in ones),
               f"first {len(ones)} requests")  # fmt: skip

        flops, bw = measure_machine()
        bound, compute_bound, memory_bound = roofline(spec, reqs, args.max_num_seqs, flops, bw)
        print(f"machine: {flops / 1e9:.1f} GFLOP/s fp32 matmul, {bw / 1e9:.1f} GB/s memory")
        print(f"roofline {bound:8.1f} output tok/s (compute {compute_bound:.1f}, "
              f"weight reads {memory_bound:.1f})")  # fmt: skip
        ours_cpu = n_out / ours.cpu
        static_cpu = sum(r.output_len for r in sub) / static.cpu
        single_cpu = sum(r.output_len for r in ones) / single.cpu
        print(f"ratio vs static batching: {ours_cpu / static_cpu:.2f}x   vs one at a time: "
              f"{ours_cpu / single_cpu:.2f}x   roofline reached: {ours_cpu / bound:.0%}"
              )  # fmt: skip


def report(name: str, timing: Timing, tokens: int, note: str) -> None:
    wall, cpu = timing.rates(tokens)
    print(f"{name:24s} {cpu:8.1f} output tok/s per CPU time ({wall:.1f} wall)  ({note})")


if __name__ == "__main__":
    main()
