"""`gpucloud generate MODEL_DIR --prompt ...`: run prompts through the serving engine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpucloud.cli.output import JsonFlag, console, emit, table


def generate(
    model_dir: Annotated[Path, typer.Argument(help="HF-format model directory.")],
    prompt: Annotated[list[str], typer.Option("--prompt", "-p", help="Repeat for a batch.")],
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 32,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: Annotated[int | None, typer.Option(help="Reproducible sampling.")] = None,
    n: Annotated[int, typer.Option(help="Completions per prompt.")] = 1,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string; repeatable.")] = None,
    ignore_eos: bool = False,
    chat: Annotated[bool, typer.Option(help="Wrap each prompt in the chat template.")] = False,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16.")] = "float32",
    quantization: Annotated[
        str | None, typer.Option(help="int8 or int4 weights, quantized at load.")
    ] = None,  # fmt: skip
    kv_cache_mb: Annotated[
        int | None, typer.Option(help="KV pool size; default: sized from free memory.")
    ] = None,  # fmt: skip
    tensor_parallel_size: Annotated[
        int, typer.Option(help="Split the model across this many processes/devices.")
    ] = 1,
    as_json: JsonFlag = False,
) -> None:
    """Generate completions for one or more prompts, with the engine's statistics."""
    import time

    from gpucloud.errors import NotFoundError
    from gpucloud.serve import LLM, SamplingParams

    if not (model_dir / "config.json").is_file():
        raise NotFoundError(f"{model_dir} is not a model directory (no config.json)")
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            seed=seed, max_tokens=max_tokens, stop=stop or [],
                            ignore_eos=ignore_eos)  # fmt: skip
    with LLM(model_dir, dtype=dtype, quantization=quantization,
             kv_cache_bytes=kv_cache_mb and kv_cache_mb << 20,
             tensor_parallel_size=tensor_parallel_size) as llm:  # fmt: skip
        texts = prompt
        if chat:
            texts = [
                llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompt
            ]
        start = time.perf_counter()
        outs = llm.generate(texts, params)
        elapsed = time.perf_counter() - start
        stats = llm.engine.stats()
    data = {
        "completions": [
            {
                "prompt": p,
                "prompt_tokens": len(o.prompt_token_ids),
                "index": c.index,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
            }
            for p, o in zip(prompt, outs, strict=True)
            for c in o.outputs
        ],  # fmt: skip
        "seconds": elapsed,
        "output_tokens_per_second": stats.generation_tokens / elapsed if elapsed else None,
        "kv_cache": {
            "blocks": stats.num_blocks,
            "block_size": stats.block_size,
            "bytes_per_token": stats.kv_bytes_per_token,
        },  # fmt: skip
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        "preemptions": stats.num_preemptions,
    }
    emit(data, as_json, _render)


def _render(data: dict) -> None:
    for c in data["completions"]:
        console.print(f"[bold]{c['prompt']!r}[/bold] → {c['text']!r}", highlight=False)
    rows = [(i, c["prompt_tokens"], len(c["token_ids"]), c["finish_reason"])
            for i, c in enumerate(data["completions"])]  # fmt: skip
    console.print(table(None, ["#", "prompt tokens", "output tokens", "finish"], rows))
    kv = data["kv_cache"]
    console.print(
        f"{data['output_tokens_per_second']:.1f} output tok/s in {data['seconds']:.2f} s; "
        f"KV pool {kv['blocks']} blocks x {kv['block_size']} tokens at "
        f"{kv['bytes_per_token']} B/token; prefix cache hit rate "
        f"{data['prefix_cache_hit_rate']:.0%}; {data['preemptions']} preemptions",
        highlight=False,
    )
