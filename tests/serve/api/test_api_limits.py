"""Bad requests, limits and auth over raw HTTP: each answer is OpenAI's error JSON with the
right status, never a 500 and never a hung connection."""

from __future__ import annotations

import httpx
import pytest
from api_helpers import assert_openai_error, start_server

KEY = "sk-limits"
MAX_LEN, MAX_BODY = 2000, 20_000
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = start_server(
        tiny_model_dir, tmp_path_factory.mktemp("logs"), "--api-key", KEY,
        "--max-model-len", str(MAX_LEN), "--max-body-bytes", str(MAX_BODY),
        "--max-num-seqs", "1", "--max-waiting", "1",
    )  # fmt: skip
    yield s
    s.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        yield c


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "hello", "max_tokens": 2, **fields}


def test_a_good_request_passes(http):
    r = http.post("/v1/completions", json=completion())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_malformed_json_is_400(http):
    r = http.post("/v1/completions", content=b'{"model": "tiny",',
                  headers={"Content-Type": "application/json"})  # fmt: skip
    assert "malformed JSON" in assert_openai_error(r, 400, "invalid_json")["message"]
    r = http.post("/v1/chat/completions", json=[1, 2])
    assert "JSON object" in assert_openai_error(r, 400, "invalid_json")["message"]


def test_invalid_fields_name_the_field(http):
    e = assert_openai_error(http.post("/v1/completions", json=completion(temperature=-1)), 400)
    assert e["param"] == "temperature"
    e = assert_openai_error(http.post("/v1/completions", json=completion(best_effort=True)), 400)
    assert e["param"] == "best_effort" and "not permitted" in e["message"]
    e = assert_openai_error(http.post("/v1/chat/completions", json={"model": "tiny"}), 400)
    assert e["param"] == "messages"
    r = http.post("/v1/completions", json=completion(n=2, temperature=0))
    assert "temperature > 0" in assert_openai_error(r, 400)["message"]
    r = http.post("/v1/completions", json=completion(prompt=[]))
    assert "empty" in assert_openai_error(r, 400)["message"]
    r = http.post("/v1/completions", json=completion(prompt=[5, 999_999]))
    assert "token ids" in assert_openai_error(r, 400)["message"]


def test_unknown_model_is_404_with_a_suggestion(http):
    e = assert_openai_error(http.post("/v1/completions", json=completion(model="tyni")), 404,
                            "model_not_found")  # fmt: skip
    assert "did you mean tiny" in e["message"]


def test_context_length_limits(http):
    r = http.post("/v1/completions", json=completion(max_tokens=MAX_LEN))
    assert f"context length of {MAX_LEN}" in assert_openai_error(r, 400)["message"]
    long_prompt = list(range(10, 10 + MAX_LEN + 1))
    r = http.post("/v1/completions", json=completion(prompt=long_prompt, max_tokens=1))
    assert f"{MAX_LEN + 1} tokens" in assert_openai_error(r, 400)["message"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 2500}]}
    assert_openai_error(http.post("/v1/chat/completions", json=chat), 400)


def test_a_body_too_large_is_413_with_or_without_content_length(http):
    big = completion(prompt="x" * MAX_BODY)
    r = http.post("/v1/completions", json=big)
    assert "limit is 20000 bytes" in assert_openai_error(r, 413, "body_too_large")["message"]

    def chunks():  # no Content-Length: the limit applies as the body streams in
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(30):
            yield b"y" * 1000
        yield b'"}'

    r = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert_openai_error(r, 413)


def test_api_key_is_required_on_v1_only(server):
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        e = assert_openai_error(anon.get("/v1/models"), 401, "invalid_api_key")
        assert "Authorization: Bearer" in e["message"]
        r = anon.post("/v1/completions", json=completion(), headers={"Authorization": "Bearer no"})
        assert_openai_error(r, 401, "invalid_api_key")
        r = anon.post("/v1/completions", json=completion(), headers={"Authorization": KEY})
        assert_openai_error(r, 401)
        for path in ("/health", "/ready", "/metrics"):
            assert anon.get(path).status_code == 200


def test_unknown_route_and_method_are_openai_errors(http):
    assert_openai_error(http.get("/v1/nothing"), 404)
    assert_openai_error(http.get("/v1/completions"), 405)


def test_a_full_queue_answers_429_with_retry_after(server, http):
    long = completion(max_tokens=MAX_LEN - 8, ignore_eos=True, stream=True)
    # max_num_seqs=1: the first request runs, the second waits, the third is one too many.
    with http.stream("POST", "/v1/completions", json=long) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # kept: a dropped iterator would close the stream
        next(lines)
        with http.stream("POST", "/v1/completions", json=long) as waiting:
            assert waiting.status_code == 200
            r = http.post("/v1/completions", json=completion())
            assert_openai_error(r, 429, "server_overloaded")
            assert r.headers["Retry-After"] == "1"
    # Both streams were dropped: their requests are aborted and the queue empties.
    server.wait_metric("gpucloud_serve_num_requests_waiting", lambda v: v == 0)
    server.wait_metric("gpucloud_serve_num_requests_running", lambda v: v == 0)
    assert http.post("/v1/completions", json=completion()).status_code == 200
    m = server.metrics()
    assert m["gpucloud_serve_requests_rejected_total[('reason', 'queue_full')]"] == 1
