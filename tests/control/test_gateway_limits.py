"""Rate limits and priority classes on the /v1 gateway, with the real `openai` client: a
tenant's and a key's requests per minute (429 in OpenAI's shape, Retry-After), tokens
settled by the answer's usage, and batch keys' requests held in the gateway while an
interactive one goes straight to the real `gpucloud serve` replica, whose engine runs it
first."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpucloud.control.errors import ForbiddenError

from . import fake_replica
from .conftest import wait_for
from .test_deployments import ENGINE_ARGS, START

# A stand-in replica that streams EVENTS server-sent events 5 ms apart; for the prompt
# "cut", it announces a longer body and hangs up after them (a replica failing mid-stream);
# for "late", its first event comes LATE seconds after its headers (a long prefill).
LATE = 0.3
EVENTS = 40
STREAMING = """
import http.server, json, sys, time

class Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if prompt == "cut":
            self.send_header("Content-Length", "1000000")
        self.end_headers()
        if prompt == "late":
            time.sleep(LATE)
        for i in range(EVENTS):
            self.wfile.write(b'data: {"i": %d}\\n\\n' % i)
            time.sleep(0.005)
        if prompt != "cut":
            self.wfile.write(b"data: [DONE]\\n\\n")
        self.close_connection = True

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Answer).serve_forever()
""".replace("EVENTS", str(EVENTS)).replace("LATE", str(LATE))


def _openai(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def _metric(server, name: str, deployment: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
        and s.labels.get("deployment") == deployment
        and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_tenant_and_key_request_limits(shared_server):
    admin = shared_server.client()
    key = admin.post("/tenants", {"name": "limited"})["api_key"]
    team = shared_server.client(key)
    team.post("/deployments", {"name": "cold", "model_dir": "/m", "replicas": 0})
    capped = team.post(
        "/tenants/limited/keys", {"name": "capped", "rate_limit": {"requests_per_minute": 2}}
    )
    assert capped["rate_limit"] == {"requests_per_minute": 2, "tokens_per_minute": None}
    assert capped["priority_class"] == "interactive"
    with pytest.raises(ForbiddenError, match="operator"):  # a tenant may not lift its own
        team.put("/tenants/limited/rate-limit", {"requests_per_minute": 100})
    tenant = admin.put("/tenants/limited/rate-limit", {"requests_per_minute": 3})
    assert tenant["rate_limit"]["requests_per_minute"] == 3

    oa = _openai(shared_server, capped["api_key"])
    for _ in range(2):  # admitted: the deployment has no replica, so 503
        with pytest.raises(openai.InternalServerError):
            oa.completions.create(model="cold", prompt="x", max_tokens=1)
    with pytest.raises(openai.RateLimitError, match="your key: 2 requests per minute") as e:
        oa.completions.create(model="cold", prompt="x", max_tokens=1)
    error = e.value.response.json()["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert e.value.response.headers["retry-after"] == "30"

    own = _openai(shared_server, key)  # the tenant's bucket: 1 of 3 left
    with pytest.raises(openai.InternalServerError):
        own.completions.create(model="cold", prompt="x", max_tokens=1)
    with pytest.raises(openai.RateLimitError, match="tenant limited: 3 requests per minute"):
        own.completions.create(model="cold", prompt="x", max_tokens=1)

    admin.put("/tenants/limited/rate-limit", {})  # lifted: only the key's own limit is left
    with pytest.raises(openai.RateLimitError, match="your key"):
        oa.completions.create(model="cold", prompt="x", max_tokens=1)
    with pytest.raises(openai.InternalServerError):
        own.completions.create(model="cold", prompt="x", max_tokens=1)
    [updated] = team.patch("/tenants/limited/keys/capped", {"rate_limit": {}})
    assert updated["rate_limit"] is None
    with pytest.raises(openai.InternalServerError):
        oa.completions.create(model="cold", prompt="x", max_tokens=1)
    assert _metric(shared_server, "gpucloud_gateway_requests_total", "cold", status="429") == 3
    actions = [e["action"] for e in admin.get("/audit")]
    assert {"tenant.rate_limit", "key.update"} <= set(actions)


def test_batch_waits_interactive_passes_and_tokens_settle(sqlite_server, tiny_model_dir):
    key = sqlite_server.client().post("/tenants", {"name": "classes"})["api_key"]
    team = sqlite_server.client(key)
    # one sequence at a time: an interactive request takes a batch one's seat (preempts it)
    engine = [*ENGINE_ARGS, "--max-num-seqs", "1"]
    team.post("/deployments", {"name": "prio", "model_dir": str(tiny_model_dir), "replicas": 1,
                               "batch_in_flight": 1, "engine_args": engine})  # fmt: skip
    bulk = team.post("/tenants/classes/keys", {"name": "bulk", "priority_class": "batch"})
    fast = team.post(
        "/tenants/classes/keys", {"name": "fast", "rate_limit": {"tokens_per_minute": 600}}
    )
    try:
        dep = wait_for(lambda: (d := team.get("/deployments/prio"))["ready_replicas"] == 1 and d,
                       timeout=START)  # fmt: skip
        clients = [_openai(sqlite_server, k["api_key"]) for k in (bulk, fast)]
        _exercise(sqlite_server, *clients, dep["replica_list"][0]["url"])
    finally:
        team.delete("/deployments/prio")
        wait_for(lambda: team.get("/deployments") == [], timeout=30)


def _exercise(server, batch: openai.OpenAI, interactive: openai.OpenAI, replica: str) -> None:
    waiting = lambda: _metric(server, "gpucloud_gateway_batch_waiting", "prio")  # noqa: E731
    long = {"max_tokens": 1900, "extra_body": {"ignore_eos": True}}
    with batch.completions.create(model="prio", prompt="x", stream=True, **long) as holder:
        next(iter(holder))  # the deployment's only batch slot is taken
        queued: list = []
        second = threading.Thread(
            target=lambda: queued.append(
                batch.completions.create(model="prio", prompt="x", max_tokens=2)
            )
        )
        second.start()
        wait_for(lambda: waiting() == 1, timeout=30)
        # an interactive request does not wait for batch ones: served while one waits.
        # Charged 100 + 2 tokens up front (400 characters / 4, max_tokens), it used 403
        # (this tokenizer: a token per character, and one to begin)
        done = interactive.completions.create(model="prio", prompt="x" * 400, max_tokens=2,
                                              extra_body={"ignore_eos": True})  # fmt: skip
        assert (done.usage.total_tokens, waiting(), queued) == (403, 1, [])
        # the gateway told the replica: its engine put the batch stream aside for it
        assert _preemptions(replica) == 1
    second.join(timeout=60)  # the stream closed: its slot went to the waiting request
    assert queued and queued[0].usage.completion_tokens == 2 and waiting() == 0
    # 600 - 403 = 197 tokens left (and 10 a second): not the 1 + 400 this one may need;
    # charged the first one's estimate alone, 498 would have let it through
    with pytest.raises(openai.RateLimitError, match="your key: 600 tokens per minute") as e:
        interactive.completions.create(model="prio", prompt="x", max_tokens=400)
    assert e.value.response.json()["error"]["type"] == "tokens"


def _preemptions(replica_url: str) -> float:
    text = httpx.get(replica_url + "/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "gpucloud_serve_num_preemptions_total"
    )


def test_batch_streams_are_relayed_in_gulps_and_requests_are_not_logged(sqlite_server):
    """A batch key's stream goes on in a few writes of whole events (its first event at
    once), not one write per event; one the replica cuts off keeps every event it sent and
    ends with the error event. The control plane logs no line per forwarded request."""
    key = sqlite_server.client().post("/tenants", {"name": "gulps"})["api_key"]
    team = sqlite_server.client(key)
    team.post("/deployments", {"name": "gulps", **fake_replica.spec(STREAMING), "replicas": 1})
    bulk = team.post("/tenants/gulps/keys", {"name": "bulk", "priority_class": "batch"})
    events = [b'data: {"i": %d}\n\n' % i for i in range(EVENTS)]
    whole = b"".join(events) + b"data: [DONE]\n\n"
    try:
        wait_for(lambda: team.get("/deployments/gulps")["ready_replicas"] == 1, timeout=START)
        for who in (key, bulk["api_key"]):
            assert b"".join(_relayed(sqlite_server, who, "x")) == whole
        writes = _relayed(sqlite_server, bulk["api_key"], "x")
        # the first write is what the gateway's first read held: the first event (a loaded
        # machine may have let a few more come first), never held back for a gulp
        assert writes[0].startswith(events[0]) and writes[0].count(b"data: ") < EVENTS // 4
        assert 2 <= len(writes) <= EVENTS // 2
        assert all(w.endswith(b"\n\n") for w in writes)
        cut = b"".join(_relayed(sqlite_server, bulk["api_key"], "cut"))
        assert cut.startswith(b"".join(events)) and cut.count(b"data: ") == EVENTS + 1
        assert b'"code": "replica_failed"' in cut
    finally:
        team.delete("/deployments/gulps")
        wait_for(lambda: team.get("/deployments") == [], timeout=30)
    assert "HTTP Request:" not in (sqlite_server.home / "server.out").read_text()


def _relayed(server, key: str, prompt: str) -> list[bytes]:
    """The pieces (HTTP chunks) a streamed completion came in through the gateway."""
    body = {"model": "gulps", "prompt": prompt, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers,
                      timeout=60) as r:  # fmt: skip
        assert r.status_code == 200
        return list(r.iter_raw())


def test_phases_to_the_first_token_are_timed(sqlite_server):
    """A stream whose replica takes LATE seconds from its headers to its first event: the
    gateway's Server-Timing header and its phase histograms put that time in `first_chunk`,
    not in admission or in the way to the replica."""
    key = sqlite_server.client().post("/tenants", {"name": "phases"})["api_key"]
    team = sqlite_server.client(key)
    team.post("/deployments", {"name": "phases", **fake_replica.spec(STREAMING), "replicas": 1})
    phase = lambda name, what: _metric(  # noqa: E731
        sqlite_server, f"gpucloud_gateway_phase_seconds_{what}", "phases",
        priority_class="interactive", phase=name,
    )  # fmt: skip
    try:
        wait_for(lambda: team.get("/deployments/phases")["ready_replicas"] == 1, timeout=START)
        body = {"model": "phases", "prompt": "late", "stream": True}
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.stream("POST", sqlite_server.url + "/v1/completions", json=body,
                          headers=headers, timeout=60) as r:  # fmt: skip
            timing = r.headers["server-timing"]
            assert r.read().endswith(b"data: [DONE]\n\n")
    finally:
        team.delete("/deployments/phases")
        wait_for(lambda: team.get("/deployments") == [], timeout=30)
    spent = {}
    for entry in timing.split(", "):
        name, dur = entry.split(";dur=")
        spent[name] = float(dur) / 1e3
    assert list(spent) == ["admit", "upstream"] and sum(spent.values()) < LATE
    counts = {name: phase(name, "count") for name in ("admit", "upstream", "first_chunk",
                                                       "first_write")}  # fmt: skip
    assert counts == {"admit": 1, "upstream": 1, "first_chunk": 1, "first_write": 1}
    # the headers left the replica just before its sleep, and reached the gateway a little
    # after: the phase the sleep falls in is first_chunk, up to that little
    assert LATE / 2 < phase("first_chunk", "sum") < LATE + 5
    assert phase("first_chunk", "sum") + spent["upstream"] >= LATE
    assert phase("admit", "sum") == pytest.approx(spent["admit"], abs=1e-4)
