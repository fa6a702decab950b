"""OpenAI's Files and Batch API on the control plane, with the real `openai` client: JSONL
in, run as batch-class requests on the tenant's real `gpucloud serve` replica, JSONL out in
OpenAI's output shape; resumed after the control plane is SIGKILLed without sending a
finished line again; bad input refused with what was wrong; another tenant's files and
batches invisible."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading

import httpx
import openai
import pytest
from http_wire import send_and_read
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, select, update

from gpucloud.control import db
from gpucloud.control.batch_runner import LINES_IN_FLIGHT, BatchRunner
from gpucloud.control.config import Settings
from gpucloud.control.gateway import Gateway
from gpucloud.control.metrics import Metrics
from gpucloud.control.models import Batch

from . import fake_replica
from .conftest import BATCH_LEASE, wait_for
from .test_deployments import ENGINE_ARGS, START
from .test_gateway import _served

# A stand-in replica that thinks as many seconds as its prompt's first word says ("0.5 a")
# and tells which prompts it got, and how often (GET /seen).
THINKING = """
import http.server, json, sys, threading, time
seen, lock = {}, threading.Lock()

class Answer(http.server.BaseHTTPRequestHandler):
    def _json(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        with lock:
            self._json(dict(seen) if self.path == "/seen" else {"status": "ok"})

    def do_POST(self):
        prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        with lock:
            seen[prompt] = seen.get(prompt, 0) + 1
        time.sleep(float(prompt.split()[0]))
        self._json({"id": "cmpl-1", "object": "text_completion", "model": "fake",
                    "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Answer).serve_forever()
"""


def _openai(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _jsonl(*lines: dict) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _request(custom_id: str, model: str, url: str = "/v1/completions", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": model, **body}}


def _lines(oa: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    """A batch's output or error file, by custom_id."""
    text = oa.files.content(file_id).text
    return {(line := json.loads(raw))["custom_id"]: line for raw in text.splitlines()}


def test_bad_input_is_refused_and_other_tenants_see_nothing(shared_server):
    admin = shared_server.client()
    key = admin.post("/tenants", {"name": "batch-input"})["api_key"]
    oa = _openai(shared_server, key)
    good = _jsonl(_request("a", "absent", prompt="x"), _request("b", "cold", prompt="y"))
    uploaded = oa.files.create(file=("in.jsonl", good), purpose="batch")
    assert (uploaded.filename, uploaded.bytes, uploaded.purpose) == ("in.jsonl", len(good), "batch")
    assert oa.files.content(uploaded.id).content == good
    assert [f.id for f in oa.files.list()] == [uploaded.id]
    with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
        oa.files.create(file=("x.jsonl", good), purpose="fine-tune")
    head = (
        f"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: {10**12}\r\n\r\n"
    )
    answer = send_and_read(shared_server.url, head.encode(), b"--b\r\n")
    assert answer.startswith(b"HTTP/1.1 413") and b'"type":"invalid_request_error"' in answer

    for lines, says in (
        (b'{"custom_id": "a"}\n{not json\n', "line 1: method must be 'POST'"),
        (good + b"{not json\n", "line 3 is not valid JSON"),
        (_jsonl(_request("a", "m", url="/v1/embeddings")), "line 1: url '/v1/embeddings' is not"),
        (_jsonl(_request("a", "m"), _request("a", "m")), "line 2: custom_id 'a' is used twice"),
        (_jsonl(_request("a", "m", stream=True)), "line 1: a batch's requests cannot stream"),
    ):
        bad = oa.files.create(file=("bad.jsonl", lines), purpose="batch")
        with pytest.raises(openai.BadRequestError, match=says):
            oa.batches.create(input_file_id=bad.id, endpoint="/v1/completions",
                              completion_window="24h")  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="endpoint must be one of /v1/chat/comp"):
        oa.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                          completion_window="24h")  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="completion_window must be one of 24h"):
        oa.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                          completion_window="1h")  # fmt: skip
    with pytest.raises(openai.NotFoundError, match="no file 'file-nope' in tenant batch-input"):
        oa.batches.create(input_file_id="file-nope", endpoint="/v1/completions",
                          completion_window="24h")  # fmt: skip

    # A line naming no deployment of the tenant is answered 404 in the error file; one of
    # a deployment with no replica waits for one, until the batch is cancelled.
    team = shared_server.client(key)
    team.post("/deployments", {"name": "cold", "model_dir": "/m", "replicas": 0})
    batch = oa.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                              completion_window="24h", metadata={"run": "1"})  # fmt: skip
    assert (batch.status, batch.request_counts.total, batch.metadata) == (
        "validating",
        2,
        {"run": "1"},
    )
    wait_for(lambda: oa.batches.retrieve(batch.id).request_counts.failed == 1)
    with pytest.raises(openai.ConflictError, match="cancel it first"):
        oa.files.delete(uploaded.id)

    stranger = _openai(shared_server, admin.post("/tenants", {"name": "batch-other"})["api_key"])
    for peek in (
        lambda: stranger.files.retrieve(uploaded.id),
        lambda: stranger.files.content(uploaded.id),
        lambda: stranger.files.delete(uploaded.id),
        lambda: stranger.batches.retrieve(batch.id),
        lambda: stranger.batches.cancel(batch.id),
    ):
        with pytest.raises(openai.NotFoundError, match="in tenant batch-other"):
            peek()
    assert stranger.files.list().data == [] and stranger.batches.list().data == []

    assert oa.batches.cancel(batch.id).status == "cancelling"
    done = wait_for(lambda: (b := oa.batches.retrieve(batch.id)).status == "cancelled" and b)
    assert done.output_file_id is None
    errors = _lines(oa, done.error_file_id)
    assert errors["a"]["response"]["status_code"] == 404
    assert errors["a"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert errors["b"]["response"] is None and errors["b"]["error"]["code"] == "batch_cancelled"
    assert [b.id for b in oa.batches.list(limit=1).data] == [batch.id]
    assert oa.files.delete(uploaded.id).deleted
    with pytest.raises(openai.AuthenticationError):
        _openai(shared_server, "gpc_nope").batches.list()


def test_a_batch_runs_on_replicas_and_resumes_after_sigkill(sqlite_server, tiny_model_dir):
    """12 lines, the last 6 long: the control plane is SIGKILLed once the first 6 are
    answered, and started again. The batch completes, each line answered once, and the
    replica generated no line to its end twice, but for the (at most 2: the deployment's
    batch slots) lines in flight at the kill."""
    key = sqlite_server.client().post("/tenants", {"name": "batcher"})["api_key"]
    team = sqlite_server.client(key)
    team.post("/deployments", {"name": "bd", "model_dir": str(tiny_model_dir), "replicas": 1,
                               "engine_args": ENGINE_ARGS})  # fmt: skip
    try:
        dep = wait_for(lambda: (d := team.get("/deployments/bd"))["ready_replicas"] == 1 and d,
                       timeout=START)  # fmt: skip
        _resume(sqlite_server, _openai(sqlite_server, key), dep["replica_list"][0]["url"])
    finally:
        team.delete("/deployments/bd")
        wait_for(lambda: team.get("/deployments") == [], timeout=30)


def _resume(server, oa: openai.OpenAI, replica: str) -> None:
    chat = "/v1/chat/completions"
    hello = [{"role": "user", "content": "hello"}]
    short = [_request(f"s{i}", "bd", chat, messages=hello, max_tokens=2, ignore_eos=True)
             for i in range(6)]  # fmt: skip
    long = [_request(f"l{i}", "bd", chat, messages=hello, max_tokens=150, ignore_eos=True)
            for i in range(6)]  # fmt: skip
    source = oa.files.create(file=("in.jsonl", _jsonl(*short, *long)), purpose="batch")
    before = _served(replica, "length")
    batch = oa.batches.create(input_file_id=source.id, endpoint=chat, completion_window="24h")
    wait_for(lambda: oa.batches.retrieve(batch.id).request_counts.completed >= 6,
             timeout=120, interval=0.02)  # fmt: skip
    progress = oa.batches.retrieve(batch.id)
    server.kill()
    assert progress.status == "in_progress" and progress.request_counts.completed < 12
    server.start()
    done = wait_for(lambda: (b := oa.batches.retrieve(batch.id)).status == "completed" and b,
                    timeout=300)  # fmt: skip
    assert (done.request_counts.completed, done.request_counts.failed) == (12, 0)
    assert done.error_file_id is None
    out = _lines(oa, done.output_file_id)
    assert sorted(out) == sorted(line["custom_id"] for line in short + long)
    for custom_id, line in out.items():
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert body["object"] == "chat.completion" and body["model"] == "bd"
        assert body["usage"]["completion_tokens"] == (150 if custom_id[0] == "l" else 2)
    served = _served(replica, "length") - before
    assert 12 <= served <= 12 + 2, served  # 2: the deployment's batch slots
    assert httpx.get(server.url + "/healthz").status_code == 200


def _batch(oa: openai.OpenAI, *lines: dict):
    source = oa.files.create(file=("in.jsonl", _jsonl(*lines)), purpose="batch")
    return oa.batches.create(input_file_id=source.id, endpoint="/v1/completions",
                             completion_window="24h")  # fmt: skip


def _ended(oa: openai.OpenAI, batch_id: str, status: str, timeout: float = 60):
    return wait_for(lambda: (b := oa.batches.retrieve(batch_id)).status == status and b,
                    timeout=timeout, interval=0.05)  # fmt: skip


def _ready_url(team, name: str) -> str:
    dep = wait_for(lambda: (d := team.get(f"/deployments/{name}"))["ready_replicas"] and d)
    return dep["replica_list"][0]["url"]


def _batch_waiting(server, deployment: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "gpucloud_gateway_batch_waiting" and s.labels["deployment"] == deployment
    )


def test_a_line_wakes_a_deployment_scaled_to_zero_and_waits_for_it(sqlite_server):
    """A batch line of a deployment at zero replicas counts as load: the autoscaler starts a
    replica, and the line waits for it instead of being retried unseen."""
    key = sqlite_server.client().post("/tenants", {"name": "batch-wake"})["api_key"]
    team, oa = sqlite_server.client(key), _openai(sqlite_server, key)
    team.post("/deployments", {"name": "sleepy", **fake_replica.spec(THINKING), "replicas": 0,
                               "autoscale": {"min_replicas": 0, "max_replicas": 1,
                                             "scale_down_delay": 1}})  # fmt: skip
    try:
        batch = _batch(oa, _request("a", "sleepy", prompt="0 a"),
                       _request("b", "sleepy", prompt="0 b"))  # fmt: skip
        done = _ended(oa, batch.id, "completed")
        assert (done.request_counts.completed, done.request_counts.failed) == (2, 0)
        moves = [e["detail"] for e in team.get("/audit") if e["action"] == "deployment.autoscale"]
        assert {"replicas": 1, "was": 0} in moves
    finally:
        team.delete("/deployments/sleepy")
        wait_for(lambda: team.get("/deployments") == [], timeout=30)


def test_cancel_drops_lines_waiting_for_a_slot_and_expiry_keeps_finished_lines(sqlite_server):
    """Cancelled while one line holds the deployment's only batch slot and three wait for
    it: those three are not sent, the one at the replica finishes. A batch whose completion
    window passed with a line still waiting (its deployment has no replica) expires: its
    finished lines in the output file, the other in the error file."""
    key = sqlite_server.client().post("/tenants", {"name": "batch-stop"})["api_key"]
    team, oa = sqlite_server.client(key), _openai(sqlite_server, key)
    team.post("/deployments", {"name": "narrow", **fake_replica.spec(THINKING), "replicas": 1,
                               "batch_in_flight": 1})  # fmt: skip
    team.post("/deployments", {"name": "never", "model_dir": "/m", "replicas": 0})
    try:
        replica = _ready_url(team, "narrow")
        batch = _batch(oa, *(_request(c, "narrow", prompt=f"2 {c}") for c in "abcd"))
        wait_for(lambda: _batch_waiting(sqlite_server, "narrow") == 3, interval=0.05)
        oa.batches.cancel(batch.id)
        done = _ended(oa, batch.id, "cancelled")
        [sent] = _lines(oa, done.output_file_id)
        errors = _lines(oa, done.error_file_id)
        assert {c: e["error"]["code"] for c, e in errors.items()} == {
            c: "batch_cancelled" for c in "abcd" if c != sent
        }
        assert httpx.get(replica + "/seen").json() == {f"2 {sent}": 1}

        batch = _batch(oa, _request("e", "narrow", prompt="0 e"),
                       _request("f", "never", prompt="0 f"),
                       _request("g", "narrow", prompt="0 g"))  # fmt: skip
        wait_for(lambda: oa.batches.retrieve(batch.id).request_counts.completed == 2)
        engine = create_engine(sqlite_server.db_url)
        with engine.begin() as conn:  # its 24 hours are over
            conn.execute(update(Batch).where(Batch.id == batch.id).values(expires_at=0.0))
        engine.dispose()
        done = _ended(oa, batch.id, "expired")
        assert sorted(_lines(oa, done.output_file_id)) == ["e", "g"]
        errors = _lines(oa, done.error_file_id)
        assert list(errors) == ["f"] and errors["f"]["error"]["code"] == "batch_expired"
    finally:
        team.delete("/deployments/narrow")
        team.delete("/deployments/never")
        wait_for(lambda: team.get("/deployments") == [], timeout=30)


@contextlib.contextmanager
def _second_control_plane(server):
    """Another control plane's batch runner on `server`'s database (and files), running
    in a thread of its own until the block ends."""
    store = db.open_store(server.db_url)
    settings = Settings(home=server.home, db_url=server.db_url, node_name="second",
                        batch_lease=BATCH_LEASE)  # fmt: skip
    gateway = Gateway(store, Metrics(store))
    runner = BatchRunner(store, settings, gateway)

    async def run() -> None:
        async with gateway.open():
            await runner.run()

    loop = asyncio.new_event_loop()
    task = loop.create_task(run())

    def serve() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(task)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        yield runner
    finally:
        loop.call_soon_threadsafe(task.cancel)
        thread.join()
        loop.close()
        store.engine.dispose()


def test_two_control_planes_on_one_database_run_a_batch_once(postgresql_server):
    """Two control planes share the PostgreSQL store: the one holding the batch's lease runs
    it, the other sends nothing; once the owner hangs (SIGSTOP) past its lease, the other
    takes the batch over and finishes it without sending its finished lines again, and the
    old owner, woken, sends no more."""
    server = postgresql_server
    key = server.client().post("/tenants", {"name": "batch-lease"})["api_key"]
    team, oa = server.client(key), _openai(server, key)
    team.post("/deployments", {"name": "leased", **fake_replica.spec(THINKING), "replicas": 1})
    engine = create_engine(server.db_url)

    def owner(batch_id: str) -> str | None:
        with engine.connect() as conn:
            return conn.scalar(select(Batch.lease_owner).where(Batch.id == batch_id))

    try:
        replica = _ready_url(team, "leased")
        with _second_control_plane(server) as second:
            prompts = [f"0.2 {i}" for i in range(16)]
            batch = _batch(oa, *(_request(p, "leased", prompt=p) for p in prompts))
            wait_for(lambda: oa.batches.retrieve(batch.id).request_counts.completed >= 2,
                     interval=0.05)  # fmt: skip
            first = owner(batch.id)
            assert first not in (None, second.owner)
            assert max(httpx.get(replica + "/seen").json().values()) == 1
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:  # (if it hung inside a transaction on the batch, its row lock holds the
                # other back until it wakes: then its lease has run out all the same)
                with contextlib.suppress(AssertionError):
                    wait_for(lambda: owner(batch.id) == second.owner, timeout=3 * BATCH_LEASE,
                             interval=0.05)  # fmt: skip
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            done = _ended(oa, batch.id, "completed")
            assert owner(batch.id) == second.owner
        assert (done.request_counts.completed, done.request_counts.failed) == (16, 0)
        assert sorted(_lines(oa, done.output_file_id)) == sorted(prompts)
        seen = httpx.get(replica + "/seen").json()
        # sent again: only the lines the first owner had in flight when it hung (at most
        # LINES_IN_FLIGHT: sent, or answered and not yet stored); without the lease both
        # control planes would send all 16
        assert sorted(seen) == sorted(prompts), seen
        assert sum(seen.values()) <= 16 + LINES_IN_FLIGHT and max(seen.values()) <= 2, seen
    finally:
        engine.dispose()
        team.delete("/deployments/leased")
        wait_for(lambda: team.get("/deployments") == [], timeout=30)
