"""`SamplingParams`: how one request turns logits into tokens and when it stops.

Field names follow the OpenAI / vLLM convention so the HTTP layer maps requests one to one.
Every check runs at construction and raises `UserError` naming the field and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpucloud.errors import UserError

MAX_SEED = 2**63 - 1  # seed + the sequence's index must stay a 64-bit torch generator seed
MAX_ID = 2**31 - 1  # token ids (and top_k) beyond any vocabulary and any tokenizer


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """What a completion must be (`structured.py` enforces it): JSON that matches `json` (a
    JSON schema, as a dict or its text), or with `json_object`, any JSON object."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        _check((self.json is None) == self.json_object,
               "structured_outputs needs exactly one of json (a JSON schema) or "
               "json_object=True")  # fmt: skip

    def schema(self) -> dict[str, Any] | str:
        return {"type": "object"} if self.json_object else self.json  # type: ignore[return-value]


@dataclass(slots=True)
class SamplingParams:
    n: int = 1  # completions per prompt; they share the prompt's KV blocks
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in the prompt or output
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    seed: int | None = None  # per-request generator: the same seed gives the same tokens
    max_tokens: int | None = 16  # None = up to the context length; 0 = the prompt only
    min_tokens: int = 0  # EOS and stop tokens are ignored until this many tokens exist
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # N: return the sampled token's logprob and the top N
    prompt_logprobs: int | None = None  # N: the same for every prompt token after the first
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # JSON (schema) constraint

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.n >= 1, "n must be >= 1")
        _check(self.temperature >= 0, "temperature must be >= 0 (0 = greedy)")
        _check(0 < self.top_p <= 1, "top_p must be in (0, 1]")
        _check(-1 <= self.top_k <= MAX_ID, f"top_k must be in [1, {MAX_ID}], or 0 / -1 for off")
        _check(0 <= self.min_p <= 1, "min_p must be in [0, 1]")
        _check(self.repetition_penalty > 0, "repetition_penalty must be > 0 (1 = off)")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]")
        _check(self.max_tokens is None or self.max_tokens >= 0, "max_tokens must be >= 0")
        _check(self.min_tokens >= 0, "min_tokens must be >= 0")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens must be <= max_tokens",
        )
        _check(all(s for s in self.stop), "stop strings must be non-empty")
        _check(
            all(0 <= t <= MAX_ID for t in self.stop_token_ids),
            f"stop_token_ids must be token ids in [0, {MAX_ID}]",
        )
        _check(self.seed is None or 0 <= self.seed <= MAX_SEED, f"seed must be in [0, {MAX_SEED}]")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]")
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
            "prompt_logprobs must be in [0, 20]",
        )
        if self.temperature == 0 and self.n > 1:
            # n greedy completions would be n copies of the same text.
            raise UserError("n > 1 needs temperature > 0 (greedy completions would be identical)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def needs_filtering(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(f"SamplingParams: {message}")
