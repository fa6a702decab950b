"""The LLM serving engine: paged KV cache, continuous batching, chunked prefill, prefix
caching and preemption. `from gpucloud.serve import LLM, SamplingParams`."""

from gpucloud.serve.config import EngineConfig
from gpucloud.serve.engine import EngineStats, LLMEngine
from gpucloud.serve.llm import LLM
from gpucloud.serve.outputs import CompletionOutput, RequestOutput
from gpucloud.serve.params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
