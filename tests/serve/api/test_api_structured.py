"""`response_format` (and vLLM's `guided_json` / `structured_outputs`) through the official
`openai` client against a real `gpucloud serve`: every answer parses and validates against
its schema, a schema the grammar library cannot take is a 400 in OpenAI's shape."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from api_helpers import assert_openai_error, start_server

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "population": {"type": "integer", "minimum": 0, "maximum": 10**6},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}  # fmt: skip
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def assert_valid(text: str, schema=SCHEMA) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_chat_response_format_json_schema_validates(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        n=3,
        temperature=1.0,
        seed=7,
        max_tokens=80,
        response_format=RESPONSE_FORMAT,
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        assert_valid(choice.message.content)


def test_streamed_chat_joins_into_a_valid_answer(client):
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                            max_tokens=80, response_format=RESPONSE_FORMAT,
                                            stream=True)  # fmt: skip
    parts, reasons = [], []
    for chunk in stream:
        parts += [c.delta.content or "" for c in chunk.choices]
        reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
    assert reasons == ["stop"]
    assert_valid("".join(parts))


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": RESPONSE_FORMAT},
        {"guided_json": SCHEMA},
        {"structured_outputs": {"json": SCHEMA}},
    ],
)
def test_completions_take_openai_and_vllm_fields(client, extra):
    r = client.completions.create(model="tiny", prompt=["Hello", "JSON:"], temperature=0,
                                  max_tokens=80, extra_body=extra)  # fmt: skip
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        assert_valid(choice.text)


def test_json_object_and_a_cut_answer(client):
    # A seed with which the random model closes its object within max_tokens.
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        temperature=0.8,
        seed=1,
        max_tokens=80,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    cut = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                         max_tokens=4, response_format=RESPONSE_FORMAT)  # fmt: skip
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].message.content.startswith('{"city')
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.choices[0].message.content)


def test_an_unsupported_schema_is_a_400(client, server):
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}},
    }
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=bad)
    assert "unsupported JSON schema" in e.value.body["message"]
    body = {"model": "tiny", "prompt": "x", "response_format": {"type": "json_schema"}}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert assert_openai_error(r, 400)["param"] == "response_format.json_schema"
    body = {"model": "tiny", "prompt": "x", "guided_json": SCHEMA,
            "response_format": {"type": "json_object"}}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert "not both" in assert_openai_error(r, 400)["message"]
