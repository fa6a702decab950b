"""What a task needs from a model, whoever runs it: the serving engine in this process
(`EngineBackend`) or an OpenAI-compatible server (`EndpointBackend`). Both tokenize prompts
their own way (the model's tokenizer, bos included), so the scoring code is one for both."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gpucloud.eval.tasks import GenerationItem


class Backend(Protocol):
    name: str  # what results call the model: a directory, or "model@url"

    def prompt_logprobs(self, prompts: Sequence[str]) -> list[list[float | None]]:
        """Per prompt, the logprob of each of its tokens given those before it; the first
        token's is None (nothing precedes it)."""
        ...

    @property
    def max_length(self) -> int:
        """The tokens of a rolling window (windows.py): the model's context minus one."""
        ...

    def text_logprobs(
        self, texts: Sequence[str], stride: int | None = None
    ) -> list[list[float | None]]:
        """As prompt_logprobs, for documents that may be longer than the model's context:
        each token's logprob given up to a window of tokens before it, windows `stride`
        tokens apart (default: max_length - 1; windows.py)."""
        ...

    def generate(self, items: Sequence[GenerationItem]) -> list[str]:
        """Per item, the greedy completion of its prompt up to its first stop string
        (excluded) or its max_tokens."""
        ...
