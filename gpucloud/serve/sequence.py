"""Requests and their sequences: the engine's bookkeeping, free of tensors.

A request with `n` completions owns `n` sequences that share the prompt. Progress is one
counter per sequence, `num_computed_tokens` (tokens whose K/V are in the cache): prefill,
chunked prefill, decode and recomputation after preemption are all "compute the tokens
from `num_computed_tokens` to `num_tokens`".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from gpucloud.serve.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks and is scheduled each step
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # the caller gave up on it


@dataclass(slots=True)
class Logprob:
    """The sampled token's log-probability and rank, and the top-N alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: dict[int, float]


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    index: int  # which of the request's n completions
    params: SamplingParams
    token_ids: list[int]  # prompt then output, one list
    num_prompt_tokens: int
    parent: Sequence | None = None  # the sibling whose prompt blocks this one shares
    priority: int = 0  # its request's: lower runs first (scheduler.py)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    num_cached_blocks: int = 0  # leading blocks registered in (or taken from) the prefix cache
    num_reused_tokens: int = 0  # prompt tokens found computed at the last admission
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token or string that ended it
    logprobs: list[Logprob] = field(default_factory=list)
    # One entry per prompt token computed so far (None for the first, which has no context);
    # kept by the first sequence of a request that asks for prompt logprobs, else None.
    prompt_logprobs: list[Logprob | None] | None = None
    detokenizer: Any = None  # gpucloud.serve.detokenizer.IncrementalDetokenizer
    generator: Any = None  # torch.Generator for a seeded request, made by the sampler
    output_counts: dict[int, int] | None = None  # token -> count, kept only for penalties
    # Guessed next tokens (speculative decoding), set before each step; never in token_ids
    # until the target model has confirmed them.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_computed_tokens: int = 0  # tokens whose K/V the draft model holds (draft.py)
    guess_state: Any = None  # spec_policy.GuessState: how well its guesses hold, once it guesses
    lora: Any = None  # gpucloud.models.lora.LoraAdapter applied to this sequence, or None
    grammar: Any = None  # llguidance.LLMatcher of a structured-output request (structured.py)

    @property
    def cache_salt(self) -> int | None:
        """What, beside its tokens, names the sequence's KV blocks: the same prompt under
        another adapter has other keys and values."""
        return None if self.lora is None else self.lora.id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Some prompt token still lacks its logprob: the prompt must be computed, not reused
        from the prefix cache (the logits of reused positions are never computed)."""
        lps = self.prompt_logprobs
        return lps is not None and len(lps) < self.num_prompt_tokens

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.output_counts is not None:
            self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


def make_request(
    request_id: str,
    prompt: str | None,
    prompt_token_ids: list[int],
    params: SamplingParams,
    arrival_time: float,
    lora: Any = None,
    priority: int = 0,
) -> Request:
    """A request and its `n` sequences; siblings share the first sequence's prompt blocks,
    and all of them run on `lora` (a LoraAdapter, or None for the base model) with
    `priority`."""
    first = _new_seq(request_id, 0, params, prompt_token_ids, None)
    seqs = [first] + [
        _new_seq(request_id, i, params, prompt_token_ids, first) for i in range(1, params.n)
    ]
    for seq in seqs:
        seq.lora, seq.priority = lora, priority
    return Request(request_id, prompt, list(prompt_token_ids), params, seqs, arrival_time)


def _new_seq(
    request_id: str, index: int, params: SamplingParams, prompt: list[int], parent
) -> Sequence:
    seq = Sequence(request_id, index, params, list(prompt), len(prompt), parent=parent)
    if params.prompt_logprobs is not None and parent is None:
        seq.prompt_logprobs = [None]  # siblings share the prompt: the first one scores it
    if params.has_penalties:
        seq.output_counts = {}
    return seq
