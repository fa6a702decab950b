"""The LLM serving engine: paged KV cache, continuous batching, chunked prefill, prefix
caching and preemption. `from gpucloud.serve import LLM, SamplingParams`."""

from gpucloud.hal.device import prefer_passive_cpu_waits

prefer_passive_cpu_waits()  # before the imports below load torch

# ruff: noqa: E402
from gpucloud.serve.config import EngineConfig
from gpucloud.serve.engine import EngineStats, LLMEngine
from gpucloud.serve.llm import LLM
from gpucloud.serve.lora import LoRARequest
from gpucloud.serve.outputs import CompletionOutput, RequestOutput
from gpucloud.serve.params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
]
