"""OpenAI requests to engine inputs, engine outputs to OpenAI responses and stream chunks."""

from __future__ import annotations

import json
import time

from gpucloud.errors import UserError
from gpucloud.models.tokenizer import Tokenizer
from gpucloud.serve.api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from gpucloud.serve.outputs import CompletionOutput, RequestOutput
from gpucloud.serve.params import SamplingParams
from gpucloud.serve.sequence import Logprob


# ---- requests ---------------------------------------------------------------------------
def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: a string, token ids, or a list of either."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise UserError("prompt must not be empty")
    if isinstance(p[0], int):
        return [list(p)]
    return list(p)


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer) -> str:
    """The conversation rendered with the model's chat template (ConfigError if it has none
    or the template rejects the messages)."""
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None):
    """SamplingParams of a request; OpenAI's defaults where the request says nothing.
    Raises UserError (from SamplingParams) for combinations it cannot serve."""
    return SamplingParams(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
    )


# ---- responses ----------------------------------------------------------------------------
def usage(finals: list[RequestOutput]) -> dict:
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    completion = sum(len(c.token_ids) for f in finals for c in f.outputs)
    cached = sum(f.num_cached_tokens for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class Formatter:
    """Builds the response or chunks of one HTTP request (`chat` picks the object shapes)."""

    def __init__(self, request_id: str, model: str, chat: bool, n: int, tokenizer: Tokenizer):
        self.id, self.model, self.chat, self.n = request_id, model, chat, n
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self._tokens: dict[int, str] = {}

    def response(self, finals: list[RequestOutput], prefixes: list[str] | None) -> dict:
        """The whole (non-streamed) response; `prefixes` start each prompt's texts (echo)."""
        choices = []
        for p, final in enumerate(finals):
            for c in final.outputs:
                prefix = prefixes[p] if prefixes else ""
                choices.append(self._choice(p * self.n + c.index, prefix + c.text, c, c.logprobs,
                                            c.finish_reason, final=True))  # fmt: skip
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, choices) | {"usage": usage(finals)}

    def chunk(
        self, prompt_index: int, c: CompletionOutput, first: bool, prefix: str = ""
    ) -> dict | None:
        """The chunk for one choice after a step, or None when it adds nothing. A choice's
        first chunk is always sent (chat clients read the role from it) and starts with
        `prefix` (the prompt, for `echo`)."""
        new = len(c.new_token_ids)
        logprobs = c.logprobs[-new:] if (c.logprobs is not None and new) else None
        if not c.text_delta and not c.finished and not logprobs and not first:
            return None
        index = prompt_index * self.n + c.index
        text = prefix + c.text_delta if first else c.text_delta
        choice = self._choice(index, text, c, logprobs, c.finish_reason, final=False)
        if self.chat and first:
            choice["delta"]["role"] = "assistant"
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [choice])

    def usage_chunk(self, finals: list[RequestOutput]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, []) | {"usage": usage(finals)}

    # ---- internals -------------------------------------------------------------------------
    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip

    def _choice(self, index, text, c: CompletionOutput, logprobs, finish, final) -> dict:
        lp = None if logprobs is None else self._logprobs(logprobs)
        choice: dict = {"index": index, "logprobs": lp, "finish_reason": finish}
        if finish is not None and c.stop_reason is not None:
            choice["stop_reason"] = c.stop_reason
        if not self.chat:
            choice["text"] = text
        elif final:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["delta"] = {"content": text} if text else {}
        return choice

    def _logprobs(self, entries: list[Logprob]) -> dict:
        if self.chat:
            return {"content": [self._chat_logprob(e) for e in entries], "refusal": None}
        tokens = [self._token(e.token_id) for e in entries]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._token(t): lp for t, lp in e.top.items()} for e in entries],
            "text_offset": offsets,
        }

    def _chat_logprob(self, e: Logprob) -> dict:
        top = [self._token_logprob(t, lp) for t, lp in e.top.items()]
        return self._token_logprob(e.token_id, e.logprob) | {"top_logprobs": top}

    def _token_logprob(self, token_id: int, logprob: float) -> dict:
        text = self._token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _token(self, token_id: int) -> str:
        text = self._tokens.get(token_id)
        if text is None:
            text = self._tokens[token_id] = self.tokenizer.decode([token_id], False)
        return text
