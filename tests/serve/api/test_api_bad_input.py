"""Bad input against a real `gpucloud serve` at its default limits: each is a 4xx in OpenAI's
shape, never a 500 and never a dead engine, and the same server answers the next normal
request. Ends with schemathesis over the server's whole OpenAPI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from api_helpers import assert_openai_error, start_server
from http_wire import send_and_read

MiB = 1 << 20
MAX_LEN = 64  # keeps what the fuzzer asks the engine for small
HOOKS = Path(__file__).with_name("schemathesis_hooks.py")
SCHEMATHESIS = str(Path(sys.executable).parent / "schemathesis")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs"),
                     "--max-model-len", str(MAX_LEN))  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:  # one kept-alive connection
        yield c


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "hello", "max_tokens": 2, **fields}


def serves(http: httpx.Client) -> bool:
    """The engine is alive and a normal request completes."""
    ok = http.post("/v1/completions", json=completion()).status_code == 200
    return ok and http.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (b"NaN", "NaN is not a JSON number; numbers must be finite"),
        (b"Infinity", "Infinity is not a JSON number; numbers must be finite"),
        (b"-Infinity", "-Infinity is not a JSON number; numbers must be finite"),
        (b"1e400", "the number 1e400 is out of range; numbers must be finite"),
        (b'"\\ud800"', "holds a lone UTF-16 surrogate (\\ud800)"),
        (b"[" * 10_000 + b"]" * 10_000, "arrays and objects are nested deeper than 64 levels"),
    ],
    ids=["nan", "inf", "-inf", "1e400", "surrogate", "deep"],
)
def test_a_body_that_is_not_strict_json_is_400(http, value, says):
    for path, body in (
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": %s}' % value),
        (
            "/v1/chat/completions",
            b'{"model": "tiny", "messages": [{"role": "user", "content": %s}]}' % value,
        ),  # fmt: skip
    ):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
        error = assert_openai_error(r, 400, "invalid_json")
        assert error["message"].startswith("invalid JSON body: ") and says in error["message"]
        assert serves(http)


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"seed": 2**64}, "seed", "less than or equal to 9223372036854775807"),
        ({"seed": -1}, "seed", "greater than or equal to 0"),
        ({"top_k": 2**70}, "top_k", "less than or equal to 2147483647"),
        ({"stop_token_ids": [2**70], "min_tokens": 1}, "stop_token_ids.0", "less than or equal"),
        ({"prompt": [5, 2**40], "echo": True}, "prompt", "2147483647"),
        ({"temperature": "NaN"}, "temperature", "finite number"),
        ({"repetition_penalty": "Infinity"}, "repetition_penalty", "finite number"),
        ({"priority": -(2**40)}, "priority", "greater than or equal to -2147483647"),
    ],
    ids=[
        "seed-2^64",
        "seed-neg",
        "top_k",
        "stop-id",
        "prompt-id",
        "nan-str",
        "inf-str",
        "priority",
    ],  # fmt: skip
)
def test_sampling_fields_out_of_range_are_400_and_the_engine_lives(http, fields, param, says):
    error = assert_openai_error(http.post("/v1/completions", json=completion(**fields)), 400)
    assert error["param"].startswith(param) and says in error["message"], error
    assert serves(http)


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "says"),
    [
        ("/tokenize", {"model": "tiny"}, 400, "prompt", "Field required"),
        ("/tokenize", {"prompt": "x", "messages": []}, 400, "messages", "Extra inputs"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model", "'nope'"),
        ("/detokenize", {"tokens": [5, 10**6]}, 400, "tokens.1", "not a token id of this model"),
        ("/detokenize", {"tokens": [2**40]}, 400, "tokens.0", "less than or equal"),
        ("/detokenize", {"tokens": "5 6"}, 400, "tokens", "valid list"),
    ],
    ids=["no-prompt", "chat-form", "model", "beyond-vocab", "beyond-ids", "not-a-list"],
)
def test_bad_tokenize_bodies_are_openai_errors(http, path, body, status, param, says):
    error = assert_openai_error(http.post(path, json=body), status)
    assert error["param"] == param and says in error["message"], error


def test_extreme_values_in_range_are_served(http):
    for fields in (
        {"seed": 2**63 - 1, "n": 3, "temperature": 1.0},  # the generator of each choice
        {"top_k": 2**31 - 1},  # larger than the vocabulary: no limit
        {"stop_token_ids": [2**31 - 1, 10**6], "min_tokens": 2},  # ids beyond the vocabulary
        {"logprobs": 20, "echo": True, "prompt": [5, 6]},
        {"repetition_penalty": 1e308, "presence_penalty": -2, "frequency_penalty": 2},
        {"priority": 2**31 - 1},
    ):
        r = http.post("/v1/completions", json=completion(**fields))
        assert r.status_code == 200, (fields, r.text)
    assert serves(http)


def test_bodies_over_8_mib_are_413_before_they_are_read_whole(server, http):
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    answer = send_and_read(server.url, head + b"content-length: %d\r\n\r\n" % (8 * MiB + 1), b"{")
    assert answer.startswith(b"HTTP/1.1 413 ") and b"the limit is 8388608 bytes" in answer
    megabyte = b"%x\r\n%s\r\n" % (MiB, b" " * MiB)
    chunked = head + b"transfer-encoding: chunked\r\n\r\n"  # 8 MiB, then the byte too many
    answer = send_and_read(server.url, chunked, *[megabyte] * 8, b"1\r\n \r\n")
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    # 5 MiB (padding is JSON whitespace) is within the default
    padded = json.dumps(completion()).encode() + b" " * (5 * MiB)
    r = http.post("/v1/completions", content=padded, headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert server.metrics()["gpucloud_serve_requests_rejected_total[('reason', 'body_too_large')]"]
    assert serves(http)


def _seed_ending_mid_character(http: httpx.Client) -> int:
    """A seed whose one sampled token is the first byte of a multi-byte character: the
    completion's text is U+FFFD, the bytes released whole at the end."""
    for seed in range(500):
        r = http.post("/v1/completions", json=completion(max_tokens=1, seed=seed))
        if r.json()["choices"][0]["text"].endswith("\ufffd"):
            return seed
    raise AssertionError("no seed in 0..499 samples a partial UTF-8 token")


def _events(http: httpx.Client, path: str, body: dict) -> list[str]:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        return [line.removeprefix("data: ") for line in r.iter_lines() if line]


def test_a_stream_that_ends_mid_character_still_finishes(http):
    seed = _seed_ending_mid_character(http)
    whole = http.post("/v1/completions", json=completion(max_tokens=1, seed=seed)).json()
    events = _events(http, "/v1/completions", completion(max_tokens=1, seed=seed, stream=True))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert chunks[-1]["finish_reason"] == "length"
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "seed": seed,
            "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    events = _events(http, "/v1/chat/completions", chat)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 1
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"


def test_no_input_makes_the_server_answer_500(server, tmp_path):
    """Every operation, positive and negative data, boundary values (the coverage phase)."""
    r = subprocess.run(
        [SCHEMATHESIS, "run", f"{server.url}/openapi.json", "--checks", "not_a_server_error",
         "--mode", "all", "--phases", "examples,coverage,fuzzing", "--max-examples", "30",
         "--seed", "7", "--generation-deterministic", "--request-timeout", "60"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS)},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    m = server.metrics()
    assert m["gpucloud_serve_request_success_total[('finished_reason', 'length')]"] > 0
    assert server.proc.poll() is None and httpx.get(f"{server.url}/health").status_code == 200
