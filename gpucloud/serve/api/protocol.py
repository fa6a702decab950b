"""OpenAI requests to engine inputs, engine outputs to OpenAI responses and stream chunks."""

from __future__ import annotations

import json
import time
from itertools import islice

from gpucloud.errors import UserError
from gpucloud.models.tokenizer import Tokenizer
from gpucloud.serve.api.errors import APIError
from gpucloud.serve.api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from gpucloud.serve.outputs import CompletionOutput, RequestOutput
from gpucloud.serve.params import SamplingParams, StructuredOutputsParams
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


def completion_params(req: CompletionRequest) -> SamplingParams:
    """SamplingParams of a completion request. The prompt is scored when `echo` comes with
    `logprobs` (OpenAI's legacy way, which evaluation harnesses use) or when vLLM's
    `prompt_logprobs` is set; the engine computes the larger of the two top-N.
    Raises APIError for `max_tokens: 0` without `echo` (it would return nothing)."""
    if req.max_tokens == 0 and not req.echo:
        message = "max_tokens: 0 generates nothing; it is allowed only with echo: true"
        raise APIError(400, f"{message} (to return or score the prompt)", "invalid_value",
                       "max_tokens")  # fmt: skip
    echoed = req.logprobs if req.echo else None
    wanted = [n for n in (echoed, req.prompt_logprobs) if n is not None]
    return sampling_params(req, req.max_tokens, req.logprobs, max(wanted) if wanted else None)


def sampling_params(
    req: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
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
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        structured_outputs=structured_outputs(req),
    )


def structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """The JSON constraint of a request, from whichever of OpenAI's `response_format` or
    vLLM's `guided_json` / `structured_outputs` it uses (APIError 400 for two at once, or
    for a kind without its schema)."""
    given = {
        "response_format": _from_response_format(req),
        "guided_json": None if req.guided_json is None else StructuredOutputsParams(
            json=req.guided_json),
        "structured_outputs": _from_vllm(req),
    }  # fmt: skip
    used = [name for name, spec in given.items() if spec is not None]
    if len(used) > 1:
        raise APIError(400, f"give one of {' or '.join(used)}, not both", "invalid_value",
                       used[1])  # fmt: skip
    return given[used[0]] if used else None


def _from_response_format(req: SamplingFields) -> StructuredOutputsParams | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None:
        raise APIError(400, "response_format of type json_schema needs a json_schema object "
                       "({name, schema, strict})", "invalid_value",
                       "response_format.json_schema")  # fmt: skip
    return StructuredOutputsParams(json=fmt.json_schema.json_schema)


def _from_vllm(req: SamplingFields) -> StructuredOutputsParams | None:
    so = req.structured_outputs
    if so is None:
        return None
    if (so.json_ is None) == (not so.json_object):
        raise APIError(400, "structured_outputs needs exactly one of json (a JSON schema) or "
                       "json_object: true", "invalid_value", "structured_outputs")  # fmt: skip
    return StructuredOutputsParams(json=so.json_, json_object=bool(so.json_object))


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


_MARK = "\x00text\x00"  # stands for a text delta in `Formatter._delta_template`


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class Formatter:
    """Builds the response or chunks of one HTTP request (`chat` picks the object shapes).

    `echo_logprobs` (completions with echo and logprobs N): each choice's logprobs start with
    the prompt tokens' (the first one None). `prompt_logprobs` (vLLM's extension, N): each
    choice carries `prompt_logprobs`, one dict per prompt token. `text_offset` counts from
    the start of the choice's text, the echoed prompt included, across stream chunks.
    """

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        n: int,
        tokenizer: Tokenizer,
        echo_logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ):
        self.id, self.model, self.chat, self.n = request_id, model, chat, n
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.echo_logprobs, self.prompt_logprobs = echo_logprobs, prompt_logprobs
        self._tokens: dict[int, str] = {}
        self._offsets: dict[int, int] = {}  # choice index -> text_offset of its next token
        self._templates: dict[int, tuple[str, str]] = {}  # choice index -> `_delta_template`

    def response(self, finals: list[RequestOutput], prefixes: list[str] | None) -> dict:
        """The whole (non-streamed) response; `prefixes` start each prompt's texts (echo)."""
        choices = []
        for p, final in enumerate(finals):
            for c in final.outputs:
                index = p * self.n + c.index
                prefix = prefixes[p] if prefixes else ""
                logprobs = self._logprobs(index, *self._with_prompt(final, c.token_ids, c.logprobs))
                choice = self._choice(index, prefix + c.text, c, logprobs, c.finish_reason,
                                      final=True)  # fmt: skip
                choices.append(self._add_prompt_logprobs(choice, final))
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, choices) | {"usage": usage(finals)}

    def event(
        self, prompt_index: int, out: RequestOutput, c: CompletionOutput, first: bool,
        prefix: str = "",
    ) -> str | None:  # fmt: skip
        """`chunk` as a server-sent event. The usual one, a text delta and nothing else, is
        filled into a template made once per choice: the same bytes as `sse(chunk(...))`
        for a fraction of the event loop's time, which every streamed token costs."""
        if first or c.finished or c.logprobs is not None or not c.text_delta:
            chunk = self.chunk(prompt_index, out, c, first, prefix)
            return None if chunk is None else sse(chunk)
        index = prompt_index * self.n + c.index
        template = self._templates.get(index)
        if template is None:
            template = self._templates[index] = self._delta_template(index, c)
        head, tail = template
        return f"{head}{json.dumps(c.text_delta)}{tail}"

    def chunk(
        self, prompt_index: int, out: RequestOutput, c: CompletionOutput, first: bool,
        prefix: str = "",
    ) -> dict | None:  # fmt: skip
        """The chunk for one choice after a step, or None when it adds nothing. A choice's
        first chunk is always sent (chat clients read the role from it) and starts with
        `prefix` (the prompt, for `echo`) and, when asked, the prompt's logprobs."""
        ids = c.new_token_ids
        entries = c.logprobs[len(c.logprobs) - len(ids) :] if (c.logprobs and ids) else None
        if first:
            ids, entries = self._with_prompt(out, ids, entries)
        if not c.text_delta and not c.finished and not entries and not first:
            return None
        index = prompt_index * self.n + c.index
        text = prefix + c.text_delta if first else c.text_delta
        logprobs = self._logprobs(index, ids, entries)
        choice = self._choice(index, text, c, logprobs, c.finish_reason, final=False)
        if self.chat and first:
            choice["delta"]["role"] = "assistant"
        if first:
            self._add_prompt_logprobs(choice, out)
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [choice])

    def usage_chunk(self, finals: list[RequestOutput]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, []) | {"usage": usage(finals)}

    # ---- internals -------------------------------------------------------------------------
    def _delta_template(self, index: int, c: CompletionOutput) -> tuple[str, str]:
        """The SSE text of a running choice's chunk, split where its text delta goes (the
        last string of the JSON)."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        choice = self._choice(index, _MARK, c, None, None, final=False)
        head, _, tail = sse(self._envelope(obj, [choice])).rpartition(json.dumps(_MARK))
        return head, tail

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip

    def _choice(self, index, text, c: CompletionOutput, logprobs, finish, final) -> dict:
        choice: dict = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None and c.stop_reason is not None:
            choice["stop_reason"] = c.stop_reason
        if not self.chat:
            choice["text"] = text
        elif final:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["delta"] = {"content": text} if text else {}
        return choice

    def _with_prompt(self, out: RequestOutput, ids: list[int], entries):
        """Token ids and logprob entries of a choice; with echo and logprobs, the prompt's
        come first."""
        if self.echo_logprobs is None or out.prompt_logprobs is None:
            return ids, entries
        return out.prompt_token_ids + ids, out.prompt_logprobs + (entries or [])

    def _add_prompt_logprobs(self, choice: dict, out: RequestOutput) -> dict:
        if self.prompt_logprobs is not None and out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = [
                None if e is None else self._prompt_entry(e) for e in out.prompt_logprobs
            ]
        return choice

    def _prompt_entry(self, e: Logprob) -> dict:
        """vLLM's shape: the prompt token and the top N, by token id, with rank and text."""
        entry = {str(e.token_id): self._ranked(e.token_id, e.logprob, e.rank)}
        for rank, (token_id, logprob) in enumerate(islice(e.top.items(), self.prompt_logprobs)):
            entry.setdefault(str(token_id), self._ranked(token_id, logprob, rank + 1))
        return entry

    def _ranked(self, token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": self._token(token_id)}

    def _logprobs(self, index: int, ids: list[int], entries) -> dict | None:
        if entries is None:
            return None
        if self.chat:
            return {"content": [self._chat_logprob(e) for e in entries], "refusal": None}
        tokens = [self._token(t) for t in ids]
        offsets, at = [], self._offsets.get(index, 0)
        for t in tokens:
            offsets.append(at)
            at += len(t)
        self._offsets[index] = at
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else self._top(e) for e in entries],
            "text_offset": offsets,
        }

    def _top(self, e: Logprob) -> dict[str, float]:
        # With echo, prompt entries may hold more than N (the engine computed prompt_logprobs').
        return {self._token(t): lp for t, lp in islice(e.top.items(), self.echo_logprobs)}

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
