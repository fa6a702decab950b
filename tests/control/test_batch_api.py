"""OpenAI's Files and Batch API on the control plane, with the real `openai` client: JSONL
in, run as batch-class requests on the tenant's real `gpucloud serve` replica, JSONL out in
OpenAI's output shape; resumed after the control plane is SIGKILLed without sending a
finished line again; bad input refused with what was wrong; another tenant's files and
batches invisible."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from http_wire import send_and_read

from .conftest import wait_for
from .test_deployments import ENGINE_ARGS, START
from .test_gateway import _served


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
