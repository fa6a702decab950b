"""Bodies the control plane refuses before routing (gpucloud.http_body), on the REST API and
on the /v1 gateway: not strict JSON → 400, larger than the limit → 413 before the body is
read whole. After each, the same server (and connection, where it stays open) answers a
normal request."""

from __future__ import annotations

import httpx
import pytest
from http_wire import send_and_read

from .conftest import Server

JOB = b'{"name": "bad", "command": "true", "gpus": %s}'
COMPLETION = b'{"model": "m", "prompt": "x", "temperature": %s}'
DEEP = b"[" * 10_000 + b"]" * 10_000
# (the value put in a body, what the refusal says)
NOT_STRICT_JSON = [
    (b"NaN", "NaN is not a JSON number; numbers must be finite"),
    (b"Infinity", "Infinity is not a JSON number; numbers must be finite"),
    (b"-Infinity", "-Infinity is not a JSON number; numbers must be finite"),
    (b"1e400", "the number 1e400 is out of range; numbers must be finite"),
    (b'"\\ud800"', "holds a lone UTF-16 surrogate (\\ud800)"),
    (b'["\\udc00 after a low half"]', "holds a lone UTF-16 surrogate (\\udc00)"),
    (DEEP, "arrays and objects are nested deeper than 64 levels"),
]
MiB = 1 << 20


@pytest.fixture
def team(shared_server, request) -> httpx.Client:
    """A new tenant's HTTP client on the shared server: one connection, kept alive."""
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)[-40:].strip("-")
    key = shared_server.client().post("/tenants", {"name": f"bad-{name}"})["api_key"]
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    with httpx.Client(base_url=shared_server.url, headers=headers, timeout=30) as http:
        yield http


@pytest.mark.parametrize(
    ("value", "says"), NOT_STRICT_JSON, ids=["nan", "inf", "-inf", "1e400", "hi", "lo", "deep"]
)
def test_a_body_that_is_not_strict_json_is_400_and_the_server_keeps_serving(team, value, says):
    r = team.post("/api/v1/jobs", content=JOB % value)
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert detail.startswith("invalid JSON body: ") and says in detail
    assert r.json()["error"] == "UserError"
    assert team.get("/api/v1/jobs").status_code == 200

    r = team.post("/v1/completions", content=COMPLETION % value)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in error["message"] and error["code"] == "invalid_json"
    assert error["type"] == "invalid_request_error"
    assert team.get("/v1/models").json() == {"object": "list", "data": []}


def test_bodies_over_the_default_limits_are_413_on_each_api(team):
    job = b'{"name": "big", "command": "' + b"x" * (20 * MiB) + b'"}'
    r = team.post("/api/v1/jobs", content=job)
    assert r.status_code == 413
    assert r.json()["detail"] == f"request body too large: the limit is {MiB} bytes"
    completion = b'{"model": "m", "prompt": "' + b"x" * (9 * MiB) + b'"}'
    r = team.post("/v1/completions", content=completion)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert f"the limit is {8 * MiB} bytes" in r.json()["error"]["message"]
    # 2 MiB: over the REST API's limit, within the gateway's (which routes it: no such model)
    padded = b'{"model": "m", "prompt": "x"}' + b" " * (2 * MiB)
    assert team.post("/api/v1/jobs", content=padded).status_code == 413
    r = team.post("/v1/completions", content=padded)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert team.get("/api/v1/jobs").status_code == 200


@pytest.fixture(scope="module")
def small_limits(tmp_path_factory):
    """A server with limits of its own (no database work here: SQLite only)."""
    home = tmp_path_factory.mktemp("limits")
    extra = ("--max-body-bytes", "2000", "--max-gateway-body-bytes", "30000")
    srv = Server(f"sqlite:///{home / 'state.db'}", home, extra=extra).start()
    yield srv
    srv.stop()


def _head(path: str, key: str, length: int | None) -> bytes:
    framing = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    return (
        f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\n{framing}\r\n\r\n"
    ).encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def test_configured_limits_are_413_before_the_body_is_read_whole(small_limits):
    key = small_limits.admin_key
    for path, limit in (("/api/v1/jobs", 2000), ("/v1/completions", 30000)):
        # declared too large: refused from the head, with one byte of the body sent
        answer = send_and_read(small_limits.url, _head(path, key, limit + 1), b"{")
        assert answer.startswith(b"HTTP/1.1 413 "), answer
        assert b"the limit is %d bytes" % limit in answer
        # chunked, no length: refused once the chunks add up to more than the limit
        parts = [_chunk(b"y" * 1000)] * (limit // 1000) + [_chunk(b"y")]  # the byte too many
        answer = send_and_read(small_limits.url, _head(path, key, None), *parts)
        assert answer.startswith(b"HTTP/1.1 413 "), answer
    with httpx.Client(base_url=small_limits.url, timeout=30) as http:
        auth = {"Authorization": f"Bearer {key}"}
        ok = {"name": "fits", "command": "true", "gpus": 1}
        assert http.post("/api/v1/jobs", json=ok, headers=auth).status_code == 201
        r = http.post("/v1/completions", json={"model": "m", "prompt": "y" * 20000}, headers=auth)
        assert r.status_code == 404  # through the guard: 30000 bytes are allowed on /v1


@pytest.mark.parametrize("gpus", [b"-1.7976931348623157e+308", b"-1", b"0", b"1e308"])
def test_gpus_out_of_range_are_422_on_jobs_and_replicas(team, gpus):
    """A finite number the share arithmetic overflowed on (-1e308 × 1000) was a 500."""
    for path, body in (
        ("/api/v1/jobs", JOB % gpus),
        ("/api/v1/deployments", b'{"name": "d", "model": "m", "gpus_per_replica": %s}' % gpus),
    ):
        r = team.post(path, content=body)
        assert r.status_code == 422, r.text
        assert "GPUs" in r.text or "less than or equal" in r.text
