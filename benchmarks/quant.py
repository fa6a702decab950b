"""Weight-only int8/int4 against the unquantized model, on every supported-model family.

For each row of the README's supported-models table (tests/hf_families.py: tiny random
models built and saved by transformers) and the `small` preset (44M parameters, where the
matmuls weigh enough for speed to mean something), in one run:

- logit error: max |Δ| of the last-position logits over random prompts, and that as a
  fraction of the largest logit; `argmax`: the fraction of prompt positions whose top token
  agrees (teacher-forced: both models read the same tokens);
- greedy agreement: the fraction of identical tokens over --steps greedy steps per prompt,
  served by the engine (a token that differs usually changes all that follow);
- speed: output tokens/s through the engine relative to the unquantized model (best of
  three runs, CPU seconds per thread: the figure that holds on a shared machine);
- memory: bytes of the loaded weights relative to the unquantized model.

    python benchmarks/quant.py                      # fp32 compute (the engine's CPU default)
    python benchmarks/quant.py --dtype bfloat16     # 16-bit compute: torch's int8 kernel
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch
from serve_offline import timed

from gpucloud.models.loader import init_model_dir, load_model
from gpucloud.serve import EngineConfig, LLMEngine, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import hf_families  # noqa: E402 - the supported-models table's tiny models

METHODS = ("int8", "int4")
REPEATS = 3  # speed: the best of three runs of the workload


def weight_bytes(model) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in model.state_dict().values()}  # fmt: skip
    return sum(storages.values())


@torch.inference_mode()
def logit_error(fp, quantized, prompts: list[list[int]]) -> tuple[float, float, float]:
    """(max |Δ logit| at the prompts' last positions, that / max |logit|, the fraction of all
    prompt positions whose argmax agrees)."""
    worst = scale = 0.0
    same = []
    for p in prompts:
        ids = torch.tensor([p])
        a, b = fp(ids)[0].float(), quantized(ids)[0].float()
        worst = max(worst, (a[-1] - b[-1]).abs().max().item())
        scale = max(scale, a[-1].abs().max().item())
        same += (a.argmax(-1) == b.argmax(-1)).tolist()
    return worst, worst / scale, sum(same) / len(same)


def generate(model_dir: Path, prompts, steps: int, dtype: str, quantization: str | None):
    """Greedy tokens per prompt, output tokens/s (CPU time per thread), weight bytes."""
    model = load_model(model_dir, dtype, quantization=quantization)
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=len(prompts), dtype=dtype))
    run(engine, [prompts[0][:4]], 2)  # warm-up
    runs = [timed(lambda: run(engine, prompts, steps)) for _ in range(REPEATS)]
    best = min(timing.cpu for _, timing in runs)
    return runs[0][0], len(prompts) * steps / best, weight_bytes(model)


def run(engine: LLMEngine, prompts: list[list[int]], steps: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    return [done[i].outputs[0].token_ids for i in ids]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ta, tb in zip(a, b, strict=True) for x, y in zip(ta, tb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def bench(name: str, model_dir: Path, args) -> None:
    fp = load_model(model_dir, args.dtype)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, fp.spec.vocab_size) for _ in range(rng.randint(8, 64))]
               for _ in range(args.prompts)]  # fmt: skip
    base_tokens, base_rate, base_bytes = generate(model_dir, prompts, args.steps, args.dtype, None)
    for method in METHODS:
        quantized = load_model(model_dir, args.dtype, quantization=method)
        err, rel, argmax = logit_error(fp, quantized, prompts)
        tokens, rate, nbytes = generate(model_dir, prompts, args.steps, args.dtype, method)
        same = agreement(base_tokens, tokens)
        print(f"{name:<28} {method:<5} {err:>11.4f} {rel:>7.1%} {argmax:>7.1%} {same:>7.1%} "
              f"{rate / base_rate:>9.2f}x {nbytes / base_bytes:>8.2f}", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=32, help="greedy steps per prompt")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    print(f"compute dtype {args.dtype}, {args.threads} thread(s); ratios against the "
          "unquantized model in this run")  # fmt: skip
    print(f"{'model':<28} {'quant':<5} {'max|Δlogit|':>10} {'rel':>7} {'argmax':>7} {'greedy':>7} "
          f"{'tokens/s':>10} {'weights':>8}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for row in hf_families.ROWS:
            hf_families.build(row, Path(tmp) / row.name)
            bench(row.name, Path(tmp) / row.name, args)
        bench("small (preset, 44M)", init_model_dir("small", Path(tmp) / "small"), args)


if __name__ == "__main__":
    main()
