"""`EngineBackend`: evaluate a model directory in this process through the serving engine
(continuous batching, chunked prefill; prompt logprobs from `SamplingParams.prompt_logprobs`).
A text longer than the model's context is scored in rolling windows (windows.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpucloud.errors import NotFoundError
from gpucloud.eval.tasks import GenerationItem
from gpucloud.eval.windows import score_in_windows, window_length


class EngineBackend:
    def __init__(self, model_dir: str | Path, **engine_config):
        from gpucloud.serve import LLM

        if not (Path(model_dir) / "config.json").is_file():
            raise NotFoundError(f"{model_dir} is not a model directory (no config.json)")
        self.name = str(model_dir)
        self.llm = LLM(model_dir, **engine_config)

    def prompt_logprobs(self, prompts: Sequence[str | list[int]]) -> list[list[float | None]]:
        from gpucloud.serve import SamplingParams

        scoring = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=0)
        outs = self.llm.generate(list(prompts), scoring)
        return [[None if e is None else e.logprob for e in out.prompt_logprobs] for out in outs]

    @property
    def max_length(self) -> int:
        return window_length(self.llm.engine.max_model_len)

    def text_logprobs(
        self, texts: Sequence[str], stride: int | None = None
    ) -> list[list[float | None]]:
        ids = [self.llm.tokenizer.encode(text) for text in texts]
        return score_in_windows(ids, self.max_length, stride, self.prompt_logprobs)

    def generate(self, items: Sequence[GenerationItem]) -> list[str]:
        from gpucloud.serve import SamplingParams

        params = [
            SamplingParams(temperature=0, max_tokens=i.max_tokens, stop=list(i.stop)) for i in items
        ]
        outs = self.llm.generate([i.prompt for i in items], params)
        return [out.outputs[0].text for out in outs]
