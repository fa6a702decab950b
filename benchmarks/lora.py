"""Multi-LoRA serving: output tokens/s of one batch whose requests are spread over 4 LoRA
adapters, against the same batch on the base model alone, measured in the same run.

Three runs of the same greedy workload, alternated `--repeats` times:
- base: an engine without LoRA (the figure to hold against);
- base via LoRA engine: the LoRA engine with no request naming an adapter (what enabling
  LoRA costs requests that do not use it);
- 4 adapters mixed: request i uses adapter i mod 4, all in the same steps (the batched
  `lora_add` op: two small matmuls per adapter per projection).
Adapters are random, in PEFT's file format, of rank `--rank` on all seven projections.

    python benchmarks/lora.py                        # small preset, 1 thread
    python benchmarks/lora.py --preset tiny --requests 8
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from serve_offline import timed

from gpucloud.models.llama import LlamaForCausalLM
from gpucloud.models.lora import ATTENTION_MODULES, TARGET_MODULES, module_shapes
from gpucloud.models.presets import PRESETS
from gpucloud.serve import EngineConfig, LLMEngine, SamplingParams

NUM_ADAPTERS = 4


def write_adapter(path: Path, model: LlamaForCausalLM, rank: int, seed: int) -> Path:
    """A random LoRA adapter in PEFT's layout (adapter_config.json, adapter_model.safetensors)."""
    spec, gen = model.spec, torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_hidden_layers):
        for module, (in_f, out_f) in module_shapes(spec).items():
            parent = "self_attn" if module in ATTENTION_MODULES else "mlp"
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.02
    path.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(TARGET_MODULES)}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, path / "adapter_model.safetensors")
    return path


def new_model(preset: str) -> LlamaForCausalLM:
    model = LlamaForCausalLM(PRESETS[preset])
    model.init_weights(0)
    return model.eval()


def run(engine: LLMEngine, prompts, adapters: list[str | None], max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params, lora_request=a)
           for p, a in zip(prompts, adapters, strict=True)]  # fmt: skip
    done = {}

    def loop():
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step() if o.finished})

    _, timing = timed(loop)
    return timing.rates(sum(len(done[i].outputs[0].token_ids) for i in ids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    vocab = PRESETS[args.preset].vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(64, 256))]
               for _ in range(args.requests)]  # fmt: skip
    config = {"max_num_seqs": args.requests, "kv_cache_bytes": 256 << 20,
              "enable_prefix_caching": False}  # fmt: skip
    plain = LLMEngine(new_model(args.preset), None, EngineConfig(**config))
    lora = LLMEngine(new_model(args.preset), None, EngineConfig(
        **config, enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=args.rank))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(NUM_ADAPTERS):
            lora.add_lora(f"a{i}", write_adapter(Path(tmp) / f"a{i}", lora.model, args.rank, i))
    mixed = [f"a{i % NUM_ADAPTERS}" for i in range(args.requests)]
    runs = {"base": (plain, [None] * args.requests),
            "base via LoRA engine": (lora, [None] * args.requests),
            f"{NUM_ADAPTERS} adapters mixed": (lora, mixed)}  # fmt: skip
    rates: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, (engine, adapters) in runs.items():
            rates[name].append(run(engine, prompts, adapters, args.max_tokens))
    print(f"preset {args.preset}, {args.requests} requests x {args.max_tokens} greedy tokens, "
          f"rank {args.rank} on all 7 projections, {args.threads} threads; output tokens per "
          f"CPU second (wall), median of {args.repeats}")  # fmt: skip
    base = statistics.median(r[1] for r in rates["base"])
    for name, r in rates.items():
        cpu, wall = statistics.median(x[1] for x in r), statistics.median(x[0] for x in r)
        print(f"{name:<22} {cpu:8.1f} tok/s ({wall:7.1f} wall)  ratio to base {cpu / base:.2f}x")


if __name__ == "__main__":
    main()
