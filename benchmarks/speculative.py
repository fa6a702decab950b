"""Speculative decoding (n-gram prompt lookup, and a draft model): acceptance rate and
speed-up against plain decoding, measured in the same run on the same model, on two
workloads:

- repetitive: code-like prompts (a random "line" of tokens repeated with one token changed
  per copy) on the preset's default random init, whose greedy continuation falls into
  loops: the case prompt lookup is for (code edits, summaries that quote their source);
- random: random-token prompts on a wider random init, whose greedy continuation does not
  repeat: proposals are rare and wrong, and speculation must not slow decoding down.

The draft model is the target's first layer with its embeddings and LM head
(`gpucloud.models.draft.first_layers`): a stand-in for a small model of the same family.
Each workload runs with requests one at a time (latency: where speculation pays) and all
at once (throughput). Plain and speculative runs alternate `--repeats` times; the script
prints the median rates, the ratio, and checks that the outputs are token-identical.

    python benchmarks/speculative.py                     # small preset, 1 thread
    python benchmarks/speculative.py --preset tiny --requests 8

One torch thread by default: on a shared machine, OpenMP threads that spin while waiting
for each other bill multi-row matmuls (a verification chunk) far more CPU time than
single-row ones, which is not what an idle machine shows.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
from serve_offline import timed

from gpucloud.models.draft import first_layers
from gpucloud.models.llama import LlamaForCausalLM
from gpucloud.models.presets import PRESETS
from gpucloud.serve import EngineConfig, LLMEngine, SamplingParams

INIT_STD = {"repetitive": 0.02, "random": 0.3}
MAX_SLOWDOWN = 0.05  # speculation may cost random text at most this share of its speed


def model_for(preset: str, workload: str) -> LlamaForCausalLM:
    model = LlamaForCausalLM(PRESETS[preset])
    model.init_weights(0, std=INIT_STD[workload])
    return model.eval()


def prompts_for(workload: str, vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        if workload == "random":
            out.append([rng.randrange(3, vocab) for _ in range(rng.randrange(64, 256))])
            continue
        line = [rng.randrange(3, vocab) for _ in range(rng.randrange(8, 24))]
        prompt = []
        for _ in range(rng.randrange(4, 10)):
            copy = list(line)
            copy[rng.randrange(len(copy))] = rng.randrange(3, vocab)
            prompt += copy
        out.append(prompt)
    return out


def run(model, prompts, args, speculative: str | None, concurrency: int):
    config = EngineConfig(max_num_seqs=concurrency, kv_cache_bytes=256 << 20,
                          speculative=speculative, num_speculative_tokens=args.k)  # fmt: skip
    draft = first_layers(model, 1) if speculative == "draft" else None
    engine = LLMEngine(model, None, config, draft)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}

    def loop():
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step() if o.finished})

    _, timing = timed(loop)
    tokens = [done[i].outputs[0].token_ids for i in ids]
    return tokens, timing, engine.stats()


def compare(model, prompts, args, concurrency: int, method: str) -> tuple[str, float]:
    """The report line of one method at one concurrency, and its speed-up per CPU time."""
    rates: dict[str | None, list[tuple[float, float]]] = {None: [], method: []}
    outputs = {}
    for _ in range(args.repeats):
        for spec in (None, method):
            tokens, timing, stats = run(model, prompts, args, spec, concurrency)
            rates[spec].append(timing.rates(sum(map(len, tokens))))
            outputs[spec] = tokens
            if spec:
                steps, drafts, rate = stats.num_steps, stats.draft_tokens, stats.acceptance_rate
            else:
                plain_steps = stats.num_steps
    (plain_wall, plain), (spec_wall, spec) = (
        [statistics.median(r[i] for r in rates[s]) for i in (0, 1)] for s in (None, method)
    )
    same = "identical" if outputs[None] == outputs[method] else "DIFFERENT"
    line = (f"{concurrency:>2} at once: plain {plain:6.1f} tok/s ({plain_steps} steps), "
            f"{method} {spec:6.1f} tok/s ({steps} steps, {drafts} drafted, {rate:.0%} accepted)"
            f"\n{'':27}speed-up {spec / plain:.2f}x per CPU time, {spec_wall / plain_wall:.2f}x "
            f"wall; outputs {same}")  # fmt: skip
    return line, spec / plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=["ngram", "draft"],
                        choices=["ngram", "draft"])  # fmt: skip
    parser.add_argument("--workloads", nargs="+", default=["repetitive", "random"],
                        choices=["repetitive", "random"])  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"preset {args.preset}, {args.requests} requests x {args.max_tokens} greedy tokens, "
          f"k={args.k}, {args.threads} threads; rates per CPU second, median of "
          f"{args.repeats}")  # fmt: skip
    worst: list[float] = []
    for workload in args.workloads:
        model = model_for(args.preset, workload)
        prompts = prompts_for(workload, model.spec.vocab_size, args.requests)
        for method in args.methods:
            for concurrency in (1, args.requests):
                line, speed_up = compare(model, prompts, args, concurrency, method)
                print(f"{workload:<10}  {line}", flush=True)
                if workload == "random":
                    worst.append(speed_up)
    if worst:  # speculation that does not pay must switch itself off (spec_policy)
        verdict = "ok" if min(worst) >= 1 - MAX_SLOWDOWN else "TOO SLOW"
        print(f"random text: slowest speculative run {min(worst):.2f}x plain per CPU time "
              f"(at least {1 - MAX_SLOWDOWN:.2f}x wanted): {verdict}")  # fmt: skip


if __name__ == "__main__":
    main()
