"""Hypothesis over the chat-completion request, along the server's own path: any object sent
as JSON is refused before routing (gpucloud.http_body: NaN, lone surrogates...), or parses,
or is refused with a validation error; what parses round-trips through JSON and turns into
SamplingParams or a UserError (a 400), as the route does, so nothing else can reach the
engine."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from json_strategies import TEXT, spoiled
from pydantic import ValidationError

from gpucloud import http_body
from gpucloud.errors import UserError
from gpucloud.http_body import BadBody
from gpucloud.serve.api.protocol import sampling_params
from gpucloud.serve.api.schemas import ChatCompletionRequest
from gpucloud.serve.params import MAX_ID, MAX_SEED, SamplingParams

MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]) | TEXT},
    optional={
        "content": st.none() | TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                     "text": TEXT}), max_size=2),
        "name": TEXT,
    },
)  # fmt: skip
# Values each field accepts, out to its bounds and a little beyond.
FIELDS = {
    "n": st.integers(0, 129),
    "temperature": st.none() | st.floats(-0.1, 2.1),
    "top_p": st.none() | st.floats(0, 1.1),
    "presence_penalty": st.floats(-2.1, 2.1),
    "frequency_penalty": st.floats(-2.1, 2.1),
    "seed": st.none() | st.integers(-1, MAX_SEED + 1) | st.integers(2**63, 2**80),
    "stop": st.none() | TEXT | st.lists(TEXT, max_size=3),
    "stream": st.booleans(),
    "stream_options": st.none()
    | st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "user": TEXT,
    "top_k": st.integers(-2, MAX_ID + 1),
    "min_p": st.floats(-0.1, 1.1),
    "repetition_penalty": st.floats(0, 1e308),
    "min_tokens": st.integers(-1, 2**40),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.none() | st.lists(st.integers(-1, MAX_ID + 1), max_size=3),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "max_tokens": st.none() | st.integers(0, 2**40),
    "max_completion_tokens": st.none() | st.integers(0, 2**40),
    "logprobs": st.booleans(),
    "top_logprobs": st.none() | st.integers(-1, 21),
    "add_generation_prompt": st.booleans(),
}
KEYS = ["model", "messages", *FIELDS, "logit_bias"]
valid_looking = st.builds(
    lambda model, messages, rest: {"model": model, "messages": messages, **rest},
    TEXT,
    st.lists(MESSAGE, min_size=1, max_size=3),
    st.fixed_dictionaries({}, optional=FIELDS),
)


requests = valid_looking | valid_looking.flatmap(lambda body: spoiled(body, KEYS))


@settings(max_examples=400, deadline=None)
@given(requests)
def test_any_chat_request_is_valid_or_refused_and_valid_ones_round_trip(body):
    try:
        sent = http_body.loads(json.dumps(body).encode())
    except BadBody:
        return
    try:
        req = ChatCompletionRequest.model_validate(sent)
    except ValidationError:
        return
    assert ChatCompletionRequest.model_validate_json(req.model_dump_json()) == req
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    try:
        params = sampling_params(req, req.max_completion_tokens or req.max_tokens, logprobs)
    except UserError:
        return
    assert isinstance(params, SamplingParams)
    assert params.seed is None or 0 <= params.seed <= MAX_SEED
    assert -1 <= params.top_k <= MAX_ID and all(0 <= t <= MAX_ID for t in params.stop_token_ids)
