"""`gpucloud serve MODEL_DIR`: the OpenAI-compatible server for one model directory.

The control plane launches exactly this command for each deployment replica, waits for
`/ready`, and stops it with SIGTERM (drained, exit 0). torch and the server stack are
imported inside the command, so `gpucloud --help` stays fast.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated

import typer

from gpucloud.cli.output import JsonFlag, console, print_json
from gpucloud.errors import UserError

_ENGINE = "Engine"
_SERVER = "Server"
_LORA = "LoRA adapters"


def serve(
    model_dir: Annotated[
        str,
        typer.Argument(help="HF-format model directory to serve: a path, or a URL (s3://...)."),
    ],
    host: Annotated[str, typer.Option(help="Address to listen on.", rich_help_panel=_SERVER)] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="Port to listen on.", rich_help_panel=_SERVER)] = 8000,
    served_model_name: Annotated[
        str | None,
        typer.Option(
            help="Model name clients send (default: the directory's name).", rich_help_panel=_SERVER
        ),
    ] = None,  # fmt: skip
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="GPUCLOUD_SERVE_API_KEY",
            rich_help_panel=_SERVER,
            help="Require 'Authorization: Bearer KEY' on /v1 routes.",
        ),
    ] = None,  # fmt: skip
    max_waiting: Annotated[
        int | None,
        typer.Option(
            min=0,
            rich_help_panel=_SERVER,
            help="Answer 429 once this many sequences wait (default: no limit).",
        ),
    ] = None,  # fmt: skip
    drain_timeout: Annotated[
        float,
        typer.Option(
            min=0,
            rich_help_panel=_SERVER,
            help="On SIGTERM, seconds in-flight requests get to finish.",
        ),
    ] = 30.0,  # fmt: skip
    request_timeout: Annotated[
        float,
        typer.Option(
            min=0.001,
            rich_help_panel=_SERVER,
            help="Seconds a request's headers and body get to arrive (408 beyond).",
        ),
    ] = 30.0,  # fmt: skip
    max_body_bytes: Annotated[
        int, typer.Option(min=1, help="Largest request body (413 beyond).", rich_help_panel=_SERVER)
    ] = 8 << 20,
    log_level: Annotated[
        str, typer.Option(help="debug, info, warning or error.", rich_help_panel=_SERVER)
    ] = "info",
    max_num_seqs: Annotated[
        int, typer.Option(help="Sequences running at once.", rich_help_panel=_ENGINE)
    ] = 64,
    max_num_batched_tokens: Annotated[
        int, typer.Option(help="Tokens per engine step.", rich_help_panel=_ENGINE)
    ] = 2048,
    block_size: Annotated[
        int, typer.Option(help="Tokens per KV block.", rich_help_panel=_ENGINE)
    ] = 16,
    kv_cache_bytes: Annotated[
        int | None,
        typer.Option(
            help="KV pool size in bytes (default: from free memory).", rich_help_panel=_ENGINE
        ),
    ] = None,  # fmt: skip
    kv_cache_memory_fraction: Annotated[
        float, typer.Option(help="Share of free memory for the KV pool.", rich_help_panel=_ENGINE)
    ] = 0.9,
    max_model_len: Annotated[
        int | None,
        typer.Option(help="Context length (default: the model's).", rich_help_panel=_ENGINE),
    ] = None,
    prefix_caching: Annotated[
        bool,
        typer.Option(help="Reuse KV blocks of shared prompt prefixes.", rich_help_panel=_ENGINE),
    ] = True,
    chunked_prefill: Annotated[
        bool, typer.Option(help="Split long prompts across steps.", rich_help_panel=_ENGINE)
    ] = True,
    dtype: Annotated[
        str, typer.Option(help="float32, bfloat16 or float16.", rich_help_panel=_ENGINE)
    ] = "float32",
    quantization: Annotated[
        str | None,
        typer.Option(
            help="int8 or int4: quantize the weights at load (GPTQ/AWQ checkpoints: automatic).",
            rich_help_panel=_ENGINE,
        ),
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="Device (default: detected).", rich_help_panel=_ENGINE)
    ] = None,
    tensor_parallel_size: Annotated[
        int,
        typer.Option(
            help="Split the model's heads, MLP and vocabulary across this many processes "
            "(one device each).",
            rich_help_panel=_ENGINE,
        ),
    ] = 1,
    speculative: Annotated[
        str | None,
        typer.Option(
            help="Speculative decoding of greedy requests: 'ngram' (prompt lookup) or 'draft' "
            "(a small model of the same family, --draft-model).",
            rich_help_panel=_ENGINE,
        ),
    ] = None,  # fmt: skip
    draft_model: Annotated[
        str | None,
        typer.Option(
            help="HF directory of the draft model ('draft'; same tokenizer as MODEL_DIR).",
            rich_help_panel=_ENGINE,
        ),
    ] = None,
    num_speculative_tokens: Annotated[
        int, typer.Option(help="Draft tokens verified per step.", rich_help_panel=_ENGINE)
    ] = 5,
    prompt_lookup_max: Annotated[
        int, typer.Option(help="Longest n-gram matched by 'ngram'.", rich_help_panel=_ENGINE)
    ] = 4,
    prompt_lookup_min: Annotated[
        int, typer.Option(help="Shortest n-gram matched by 'ngram'.", rich_help_panel=_ENGINE)
    ] = 2,
    lora_modules: Annotated[
        list[str] | None,
        typer.Option(
            rich_help_panel=_LORA,
            help="NAME=PATH of a PEFT adapter that requests select with model=NAME "
            "(repeat the option, or list several after it, as vLLM does).",
        ),
    ] = None,
    more_lora_modules: Annotated[list[str] | None, typer.Argument(hidden=True)] = None,
    enable_lora: Annotated[
        bool,
        typer.Option(
            help="Serve LoRA adapters (implied by --lora-modules).", rich_help_panel=_LORA
        ),  # fmt: skip
    ] = False,
    max_loras: Annotated[
        int, typer.Option(help="Distinct adapters in one engine step.", rich_help_panel=_LORA)
    ] = 4,
    max_lora_rank: Annotated[
        int, typer.Option(help="Largest adapter rank served.", rich_help_panel=_LORA)
    ] = 16,
    runtime_lora_updating: Annotated[
        bool,
        typer.Option(
            rich_help_panel=_LORA,
            help="Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (they read any "
            "path this server can).",
        ),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Serve MODEL_DIR with the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions)
    plus /health, /ready and /metrics, until SIGTERM (drains, exits 0) or Ctrl-C."""
    levels = ("debug", "info", "warning", "error")
    if log_level not in levels:
        raise UserError(f"log level {log_level!r} is not one of {', '.join(levels)}")
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from gpucloud.storage import local_copy

    adapters = lora_adapters([*(lora_modules or []), *(more_lora_modules or [])],
                             bool(lora_modules))  # fmt: skip
    local_dir = local_copy(model_dir)  # a URL's files are fetched once into a local cache
    from gpucloud.serve import EngineConfig, LLMEngine
    from gpucloud.serve.api import APISettings, build_app, run

    config = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        kv_cache_bytes=kv_cache_bytes,
        kv_cache_memory_fraction=kv_cache_memory_fraction,
        enable_prefix_caching=prefix_caching,
        enable_chunked_prefill=chunked_prefill,
        max_model_len=max_model_len,
        dtype=dtype,
        quantization=quantization,
        device=device,
        speculative=speculative,
        draft_model=draft_model and str(local_copy(draft_model)),
        num_speculative_tokens=num_speculative_tokens,
        prompt_lookup_max=prompt_lookup_max,
        prompt_lookup_min=prompt_lookup_min,
        enable_lora=enable_lora or bool(adapters) or runtime_lora_updating,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        tensor_parallel_size=tensor_parallel_size,
    )
    name = served_model_name or local_dir.resolve().name
    if name in adapters:
        raise UserError(f"LoRA adapter name {name!r} is the served model's name: pick another")
    settings = APISettings(name, api_key, max_waiting, max_body_bytes, runtime_lora_updating)
    engine = LLMEngine.from_model_dir(local_dir, config)
    for adapter, path in adapters.items():
        engine.add_lora(adapter, local_copy(path))
    loaded = time.time()
    facts = {
        "model": name,
        "url": f"http://{host}:{port}/v1",
        "max_model_len": engine.max_model_len,
        "kv_cache_tokens": engine.capacity_tokens,
        "auth": api_key is not None,
        "lora_adapters": list(adapters),
        "tensor_parallel_size": tensor_parallel_size,
        "worker_pids": engine.workers.pids if engine.workers else [],
    }
    if as_json:
        print_json(facts)
    else:
        console.print(
            f"serving [bold]{name}[/bold] at {facts['url']} (context {engine.max_model_len} "
            f"tokens, KV cache {engine.capacity_tokens} tokens"
            f"{f', {tensor_parallel_size} tensor-parallel ranks' if engine.workers else ''}"
            f"{', API key required' if api_key else ''})"
            + (f"; LoRA adapters: {', '.join(adapters)}" if adapters else ""),
            highlight=False,
        )
    try:
        run(build_app(engine, settings, loaded), host, port, drain_timeout, log_level,
            read_timeout=request_timeout)  # fmt: skip
    finally:
        engine.shutdown()


def lora_adapters(specs: list[str], flagged: bool) -> dict[str, str]:
    """{name: path} from `--lora-modules NAME=PATH ...`. Raises UserError for a value that is
    not NAME=PATH, a name given twice, or NAME=PATH values without the option."""
    if specs and not flagged:
        raise UserError(f"unexpected argument {specs[0]!r}: LoRA adapters go after "
                        "--lora-modules as NAME=PATH")  # fmt: skip
    adapters: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise UserError(f"--lora-modules {spec!r}: give NAME=PATH (a PEFT adapter directory)")
        if name in adapters:
            raise UserError(f"--lora-modules names {name!r} twice")
        adapters[name] = path
    return adapters
