"""`LLM`: offline batch generation over the engine, in the field's usual shape."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpucloud.errors import UserError
from gpucloud.serve.config import EngineConfig
from gpucloud.serve.engine import LLMEngine
from gpucloud.serve.lora import LoRARequest
from gpucloud.serve.outputs import RequestOutput
from gpucloud.serve.params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Load a model directory once, then `generate` for batches of prompts.

    >>> llm = LLM("models/tiny", max_num_seqs=64, enable_prefix_caching=True)
    >>> outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=8, temperature=0))

    With `enable_lora=True`, `generate(..., lora_request=LoRARequest("sql", 1, path))` runs
    the prompts on a PEFT adapter (one for all prompts, or one per prompt, None = base).
    """

    def __init__(self, model: str | Path, **config):
        self.engine = LLMEngine.from_model_dir(model, EngineConfig(**config))

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (`tensor_parallel_size` > 1); a no-op otherwise."""
        self.engine.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt is a string or a list of token ids. `params` is one SamplingParams for all,
        or one per prompt; so is `lora_request`. Raises UserError (bad prompt, params or
        adapter) or CapacityError before anything runs.
        """
        prompts = _as_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise UserError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        loras = _per_prompt(lora_request, len(prompts))
        ids = [
            self.engine.add_request(p, sp, lora_request=lr)
            for p, sp, lr in zip(prompts, params, loras, strict=True)
        ]
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]


def _per_prompt(lora_request, count: int) -> list:
    if lora_request is None or isinstance(lora_request, LoRARequest | str):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise UserError(f"got {len(loras)} LoRA requests for {count} prompts")
    return loras


def _as_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
