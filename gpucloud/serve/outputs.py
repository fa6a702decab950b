"""What the engine returns: per request, per step or at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpucloud.serve.sequence import Logprob, Request, Sequence


@dataclass(slots=True)
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str  # the whole output text so far
    token_ids: list[int]  # the whole output so far
    text_delta: str  # text released by this step (for streaming)
    new_token_ids: list[int]  # tokens added by this step
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: list[Logprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # One per prompt token (None for the first) when the request asked for prompt_logprobs.
    prompt_logprobs: list[Logprob | None] | None = None


def completion(seq: Sequence, new_tokens: int) -> CompletionOutput:
    """A snapshot of one sequence, with what the last step added."""
    finished = seq.finish_reason is not None
    detok = seq.detokenizer
    if detok is not None:
        text, delta = detok.text, detok.delta(finished)
    else:
        text = delta = ""
    outputs = seq.output_ids
    return CompletionOutput(
        index=seq.index,
        text=text,
        token_ids=outputs,
        text_delta=delta,
        new_token_ids=outputs[len(outputs) - new_tokens :] if new_tokens else [],
        finish_reason=seq.finish_reason.value if finished else None,
        stop_reason=seq.stop_reason,
        logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
    )


def request_output(req: Request, new_tokens: dict[int, int], cached_tokens: int) -> RequestOutput:
    prompt_logprobs = req.seqs[0].prompt_logprobs
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=req.prompt_token_ids,
        outputs=[completion(s, new_tokens.get(s.index, 0)) for s in req.seqs],
        finished=req.finished,
        num_cached_tokens=cached_tokens,
        prompt_logprobs=None if prompt_logprobs is None else list(prompt_logprobs),
    )
