"""`EngineConfig`: every knob of the serving engine, checked once at construction."""

from __future__ import annotations

from dataclasses import dataclass

from gpucloud.errors import ConfigError
from gpucloud.models.quant_config import METHODS as QUANTIZATIONS

DTYPES = ("float32", "bfloat16", "float16", "float64")  # float64: reference runs, tests
SPECULATIVE_METHODS = (None, "ngram", "draft")


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 64  # sequences running at once
    max_num_batched_tokens: int = 2048  # tokens per step: prefill chunks plus decodes
    block_size: int = 16  # tokens per KV block
    kv_cache_bytes: int | None = None  # None: a fraction of free device memory
    kv_cache_memory_fraction: float = 0.9  # of free memory after weights and activations
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    dtype: str = "float32"
    quantization: str | None = None  # int8 | int4 weights, quantized at load (GPTQ/AWQ: auto)
    device: str | None = None  # None: the detected backend (hal)
    # Speculative decoding of greedy requests: None (off), "ngram" (prompt lookup) or "draft"
    # (a small model of the same family, from `draft_model`).
    speculative: str | None = None
    draft_model: str | None = None  # the draft's HF directory ("draft")
    num_speculative_tokens: int = 5  # draft tokens verified per step
    prompt_lookup_max: int = 4  # longest n-gram matched ("ngram")
    prompt_lookup_min: int = 2  # shortest n-gram that yields a proposal ("ngram")
    # LoRA adapters chosen per request (PEFT format): at most max_loras distinct ones run in
    # a step, each of rank <= max_lora_rank.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    # Ranks the model is split across (attention heads, MLP, vocabulary), one process each:
    # the engine's own and tensor_parallel_size - 1 workers (gpucloud.serve.tp).
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_loras",
                     "max_lora_rank", "tensor_parallel_size"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ConfigError("kv_cache_bytes must be positive, or None to size it from memory")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ConfigError("kv_cache_memory_fraction must be in (0, 1]")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("max_model_len must be a positive integer")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported: use {', '.join(DTYPES)}")
        self._check_speculative()
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ConfigError(
                f"quantization {self.quantization!r} is not supported: use "
                f"{' or '.join(QUANTIZATIONS)} (GPTQ and AWQ checkpoints need none)"
            )
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_model_len > self.max_num_batched_tokens
        ):
            raise ConfigError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )

    def _check_speculative(self) -> None:
        if self.speculative not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative {self.speculative!r} is not supported: use "
                f"{' or '.join(m for m in SPECULATIVE_METHODS if m)}, or None for off"
            )
        if self.draft_model is not None and self.speculative != "draft":
            raise ConfigError("a draft model needs speculative='draft' "
                              "(--speculative draft --draft-model DIR)")  # fmt: skip
        if self.num_speculative_tokens < 1:
            raise ConfigError("num_speculative_tokens must be a positive integer")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("prompt_lookup_min and _max must satisfy 1 <= min <= max")
