"""Structured output: decoding speed with a JSON-schema grammar against free decoding,
measured in the same run on the same model and prompts.

Three runs per repeat, alternated: every request free, every request constrained to
SCHEMA, and half and half in one batch (the mask is computed for the constrained rows
only). Rates are generated tokens per CPU second; the script prints the medians, the
ratios to free decoding, and checks every finished constrained answer against the schema
(with jsonschema).

    python benchmarks/structured_output.py                  # small preset, 16 requests
    python benchmarks/structured_output.py --preset tiny --requests 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import jsonschema
import torch
from serve_offline import timed

from gpucloud.models.loader import init_model_dir
from gpucloud.serve import LLM, SamplingParams
from gpucloud.serve.params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 16},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 8},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 8},
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "tags", "scores", "active"],
    "additionalProperties": False,
}


def params_for(kind: str, max_tokens: int, seed: int) -> SamplingParams:
    structured = StructuredOutputsParams(json=SCHEMA) if kind == "json" else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed, ignore_eos=True,
                          structured_outputs=structured)  # fmt: skip


def run(llm: LLM, prompts: list[str], kinds: list[str], max_tokens: int):
    params = [params_for(k, max_tokens, i) for i, k in enumerate(kinds)]
    outs, timing = timed(lambda: llm.generate(prompts, params))
    finished = 0
    for out, kind in zip(outs, kinds, strict=True):
        c = out.outputs[0]
        if kind == "json" and c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)
            finished += 1
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return timing.rates(tokens)[1], tokens, finished


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(init_model_dir(args.preset, f"{tmp}/model", seed=0), kv_cache_bytes=256 << 20)
    prompts = [f"Record {i} as JSON:" for i in range(args.requests)]
    half = ["json", "free"] * (args.requests // 2) + ["json"] * (args.requests % 2)
    runs = {"free": ["free"] * args.requests, "json": ["json"] * args.requests, "mixed": half}
    rates: dict[str, list[float]] = {name: [] for name in runs}
    summary = {}
    for _ in range(args.repeats):
        for name, kinds in runs.items():
            rate, tokens, finished = run(llm, prompts, kinds, args.max_tokens)
            rates[name].append(rate)
            summary[name] = (tokens, finished, kinds.count("json"))
    print(f"preset {args.preset}, {args.requests} requests, max_tokens {args.max_tokens}, "
          f"{args.threads} threads; tokens per CPU second, median of {args.repeats}")  # fmt: skip
    free = statistics.median(rates["free"])
    for name in runs:
        rate = statistics.median(rates[name])
        tokens, finished, constrained = summary[name]
        print(f"{name:<6} {rate:7.1f} tok/s  {rate / free:.2f}x free  ({tokens} tokens; "
              f"{finished}/{constrained} constrained answers complete and valid)")  # fmt: skip


if __name__ == "__main__":
    main()
