"""Health, metrics, cancellation and shutdown of a real `gpucloud serve` process."""

from __future__ import annotations

import json
import signal
import socket
import time

import httpx
import psutil
import pytest
from api_helpers import assert_openai_error, start_server
from http_wire import read_until_closed

P = "gpucloud_serve_"
ABORTED = f"{P}request_success_total[('finished_reason', 'abort')]"
LONG = {"model": "tiny", "prompt": "hello", "max_tokens": 1900, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), "--request-timeout", "3")
    yield s
    s.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def events(lines) -> list:
    """The JSON payloads of server-sent events, until [DONE] (included as the string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
            if data == "[DONE]":
                break
    return out


def test_health_and_ready(server, http):
    """/ready also says when the process started, its weights were loaded and it became
    ready (a cold start's phases), as /metrics does."""
    assert http.get("/health").json() == {"status": "ok"}
    ready = http.get("/ready").json()
    assert ready["status"] == "ready"
    started = ready["startup"]
    assert started["process_started"] < started["weights_loaded"] < started["ready"] < time.time()
    assert started["process_started"] == psutil.Process(server.proc.pid).create_time()
    m = server.metrics()
    for phase, at in started.items():
        assert m[f"{P}startup_timestamp_seconds[('phase', '{phase}')]"] == at


def test_metrics_count_what_was_served(server, http):
    before = server.metrics()
    prompts = ["alpha", "beta gamma", "delta"]
    usages = [
        http.post("/v1/completions", json={**LONG, "prompt": p, "max_tokens": 5}).json()["usage"]
        for p in prompts
    ]
    after = server.metrics()

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta(f"{P}generation_tokens_total") == 15
    assert delta(f"{P}prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    for h in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert delta(f"{P}{h}_seconds_count") == 3
        assert delta(f"{P}{h}_seconds_sum") > 0
    assert delta(f"{P}request_success_total[('finished_reason', 'length')]") == 3
    assert after[f"{P}num_requests_running"] == after[f"{P}num_requests_waiting"] == 0
    assert after[f"{P}kv_cache_usage_perc"] == 0
    assert after[f"{P}kv_cache_blocks"] > 0


def test_prefix_cache_hits_show_in_usage_and_metrics(server, http):
    body = {**LONG, "prompt": list(range(100, 164)), "max_tokens": 2}
    first = http.post("/v1/completions", json=body).json()["usage"]
    second = http.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == 48  # 3 full blocks of 16
    assert server.metrics()[f"{P}prefix_cache_hit_rate"] > 0


def test_a_dropped_stream_aborts_and_frees_its_blocks(server, http):
    aborted = server.metrics().get(ABORTED, 0.0)
    with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()  # kept: dropping the iterator would close the stream
        assert next(lines).startswith("data: ")
        m = server.metrics()
        assert m[f"{P}num_requests_running"] == 1 and m[f"{P}kv_cache_usage_perc"] > 0
    m = server.wait_metric(ABORTED, lambda v: v == aborted + 1)
    m = server.wait_metric(f"{P}kv_cache_usage_perc", lambda v: v == 0)
    assert m[f"{P}num_requests_running"] == 0


def test_a_client_that_gives_up_on_a_plain_request_aborts_it(server):
    aborted = server.metrics().get(ABORTED, 0.0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.5))
    m = server.wait_metric(ABORTED, lambda v: v == aborted + 1)
    m = server.wait_metric(f"{P}kv_cache_usage_perc", lambda v: v == 0)
    assert m[f"{P}num_requests_running"] == 0


def drain_server(model_dir, tmp_path, drain_timeout: float):
    return start_server(model_dir, tmp_path, "--drain-timeout", str(drain_timeout))


def test_sigterm_drains_in_flight_requests_then_exits_0(tiny_model_dir, tmp_path):
    s = drain_server(tiny_model_dir, tmp_path, 60)
    body = {**LONG, "max_tokens": 1000, "stream": True, "stream_options": {"include_usage": True}}
    with (
        httpx.Client(base_url=s.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        next(lines)
        s.proc.send_signal(signal.SIGTERM)
        ready = http.get("/ready")
        assert ready.status_code == 503 and ready.json() == {"status": "draining"}
        assert http.get("/health").status_code == 200
        refused = http.post("/v1/completions", json={**LONG, "max_tokens": 2})
        assert_openai_error(refused, 503, "server_draining")
        rest = events(lines)
    assert rest[-1] == "[DONE]"
    assert rest[-2]["usage"]["completion_tokens"] == 1000
    assert rest[-3]["choices"][0]["finish_reason"] == "length"
    assert s.proc.wait(30) == 0


def test_the_drain_timeout_aborts_what_is_left(tiny_model_dir, tmp_path):
    s = drain_server(tiny_model_dir, tmp_path, 0.2)
    with (
        httpx.Client(base_url=s.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r,
    ):
        lines = r.iter_lines()
        next(lines)
        s.proc.send_signal(signal.SIGTERM)
        rest = events(lines)
    assert rest[-1] == "[DONE]"
    assert rest[-2]["choices"][0]["finish_reason"] == "abort"
    assert s.proc.wait(30) == 0


def test_a_body_that_stops_coming_gets_408_and_the_server_goes_on(server, http):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-length: 100\r\n\r\n{")
        assert read_until_closed(conn).startswith(b"HTTP/1.1 408 ")
    assert http.get("/ready").status_code == 200
