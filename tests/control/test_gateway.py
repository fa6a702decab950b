"""The /v1 gateway with the real `openai` client: a tenant's deployments by name, routed
over their ready replicas of the real `gpucloud serve` by prompt prefix within a load bound,
streams relayed and dropped ones aborted on the replica (or ended by an error event when
the replica dies), other tenants' deployments invisible, errors in OpenAI's shape."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from gpucloud.control import executors, server
from gpucloud.control.auth import authenticate
from gpucloud.control.config import Settings
from gpucloud.control.gateway import Gateway
from gpucloud.control.lifecycle import ReplicaState
from gpucloud.control.metrics import Metrics
from gpucloud.control.models import Replica
from gpucloud.control.schemas import DeploymentSpec
from gpucloud.control.services import deployments
from gpucloud.errors import UserError

from .conftest import wait_for
from .test_deployments import ENGINE_ARGS, START, _serve_process

LONG = {"max_tokens": 1900, "extra_body": {"ignore_eos": True}}
SYSTEM = "You are the support assistant of a bank. Answer in one short sentence. " * 4


def _served(replica_url: str, reason: str) -> float:
    """Completions a replica finished with `reason`, from its own /metrics."""
    text = httpx.get(replica_url + "/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "gpucloud_serve_request_success_total"
        and s.labels.get("finished_reason") == reason
    )


def _gateway_count(server, deployment: str, status: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "gpucloud_gateway_requests_total"
        and (s.labels["deployment"], s.labels["status"]) == (deployment, status)
    )


def test_gateway_routes_balances_streams_and_isolates(sqlite_server, tiny_model_dir):
    admin = sqlite_server.client()
    key = admin.post("/tenants", {"name": "gateway"})["api_key"]
    team = sqlite_server.client(key)
    team.post("/deployments", {"name": "gw", "model_dir": str(tiny_model_dir), "replicas": 2,
                               "engine_args": ENGINE_ARGS})  # fmt: skip
    team.post("/deployments", {"name": "cold", "model_dir": "/m", "replicas": 0})
    try:
        _exercise(sqlite_server, team, key)
    finally:  # replicas outlive a control plane that stops: delete them whatever happened
        for name in ("gw", "cold"):
            team.delete(f"/deployments/{name}")
        wait_for(lambda: team.get("/deployments") == [], timeout=30)


def _exercise(server, team, key: str) -> None:
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)
    with pytest.raises(openai.InternalServerError, match="no ready replica") as cold:
        oa.completions.create(model="cold", prompt="hi", max_tokens=1)
    assert cold.value.status_code == 503
    assert cold.value.response.headers["retry-after"] == "1"

    dep = wait_for(lambda: (d := team.get("/deployments/gw"))["ready_replicas"] == 2 and d,
                   timeout=START)  # fmt: skip
    urls = [r["url"] for r in dep["replica_list"]]
    assert [m.id for m in oa.models.list()] == ["cold", "gw"]

    greedy = {"temperature": 0, "extra_body": {"ignore_eos": True}}
    before = [_served(u, "length") for u in urls]
    for i in range(4):  # questions after one system prompt: its replica has it cached
        done = oa.completions.create(model="gw", prompt=SYSTEM + f"Question {i}?", max_tokens=5,
                                     **greedy)  # fmt: skip
        assert done.model == "gw" and done.usage.completion_tokens == 5
        assert (done.usage.prompt_tokens_details.cached_tokens > 0) == (i > 0)
    served = [_served(u, "length") - b for u, b in zip(urls, before, strict=True)]
    assert sorted(served) == [0, 4]
    owner, other = (urls[0], urls[1]) if served[0] else (urls[1], urls[0])

    pieces = list(oa.completions.create(model="gw", prompt="x", max_tokens=6, stream=True,
                                        **greedy))  # fmt: skip
    whole = oa.completions.create(model="gw", prompt="x", max_tokens=6, **greedy).choices[0].text
    assert len(pieces) > 1 and "".join(p.choices[0].text for p in pieces if p.choices) == whole
    chat = oa.chat.completions.create(
        model="gw", messages=[{"role": "user", "content": "hello"}], max_tokens=3
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 3

    aborted = sum(_served(u, "abort") for u in urls)
    long = {"model": "gw", "prompt": SYSTEM, "stream": True, **LONG}
    with oa.completions.create(**long) as one, oa.completions.create(**long) as two:
        next(iter(one))  # the first tokens, then the client hangs up
        next(iter(two))
        assert _running(owner) == 2  # the bound on 2 replicas allows 2 of 2 in flight...
        skipped = _served(other, "length")
        oa.completions.create(model="gw", prompt=SYSTEM, max_tokens=1)
        assert _served(other, "length") == skipped + 1  # ... and not 3 of 3
    wait_for(lambda: sum(_served(u, "abort") for u in urls) == aborted + 2, timeout=60)
    with pytest.raises(openai.APITimeoutError):  # a whole answer the client stops waiting for
        oa.with_options(timeout=1.0).completions.create(model="gw", prompt="x", **LONG)
    wait_for(lambda: sum(_served(u, "abort") for u in urls) == aborted + 3, timeout=60)

    stranger = server.client().post("/tenants", {"name": "gateway-other"})["api_key"]
    other = openai.OpenAI(base_url=server.url + "/v1", api_key=stranger, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="no deployment 'gw' in tenant gateway-other"):
        other.completions.create(model="gw", prompt="x", max_tokens=1)
    assert other.models.list().data == []
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="gpc_nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="invalid or revoked API key"):
        bad.models.list()
    assert _gateway_count(server, "gw", "200") == 10
    assert _gateway_count(server, "cold", "503") == 1
    assert _gateway_count(server, "gw", "499") == 1  # the client that left


def test_gateway_refuses_bad_bodies_in_openais_shape(shared_server):
    key = shared_server.client().post("/tenants", {"name": "gateway-bad"})["api_key"]
    url = shared_server.url + "/v1/completions"
    auth = {"Authorization": f"Bearer {key}"}
    for body, status, says in (
        (b"{not json", 400, "malformed JSON body"),
        (b'{"prompt": "x"}', 400, "'model' must name one of your deployments"),
        (b'{"model": "absent"}', 404, "no deployment 'absent' in tenant gateway-bad (yours: none)"),
        (b'{"model": "x", "prompt": "' + b"a" * (9 << 20) + b'"}', 413, "body too large"),
    ):
        r = httpx.post(url, content=body, headers=auth, timeout=30)
        assert r.status_code == status and says in r.json()["error"]["message"], r.text
    assert httpx.post(url, content=b"{}", timeout=30).json()["error"]["type"] == (
        "authentication_error"
    )


def test_a_deployment_may_not_rename_its_model(shared_server):
    team = shared_server.tenant("gateway-name")
    with pytest.raises(UserError, match="--served-model-name is the deployment's name"):
        team.post("/deployments", {"name": "d", "model_dir": "/m",
                                   "engine_args": ["--served-model-name=x"]})  # fmt: skip


def test_only_ready_replicas_are_routed(db_url, tmp_path):
    """A FAILED replica (its process still there while it is stopped) leaves the routes as
    soon as the store says so, as does every replica not READY."""
    settings = Settings(home=tmp_path, db_url=db_url, virtual_gpus=2, node_name="n1")
    store, key = server.prepare(settings, executors.create(settings))
    gateway = Gateway(store, Metrics(store))
    try:
        with store.transaction() as s:
            spec = DeploymentSpec(name="d", model_dir="/m", replicas=2)
            deployments.create(s, authenticate(s, key), spec)
            for port, r in enumerate(s.scalars(select(Replica).order_by(Replica.index)), 8001):
                r.state, r.url = ReplicaState.READY, f"http://127.0.0.1:{port}"
        assert [url for _, url in gateway._resolve(key, "d")[0].replicas] == [
            "http://127.0.0.1:8001", "http://127.0.0.1:8002"
        ]  # fmt: skip
        for state in (ReplicaState.FAILED, ReplicaState.STARTING, ReplicaState.RESTARTING):
            with store.transaction() as s:
                s.scalars(select(Replica).where(Replica.index == 0)).one().state = state
            assert [url for _, url in gateway._resolve(key, "d")[0].replicas] == [
                "http://127.0.0.1:8002"
            ]
    finally:
        store.close()


def test_a_replica_that_dies_mid_request_is_retried_or_ends_the_stream(
    sqlite_server, tiny_model_dir
):
    """A replica killed while it generates a non-streamed answer: the gateway sends the
    request to the other replica, and the client gets a whole answer. The other one killed
    while it streams: the stream ends with an error event, and both are restarted."""
    key = sqlite_server.client().post("/tenants", {"name": "gateway-retry"})["api_key"]
    team = sqlite_server.client(key)
    team.post("/deployments", {"name": "twin", "model_dir": str(tiny_model_dir), "replicas": 2,
                               "engine_args": ENGINE_ARGS})  # fmt: skip
    try:
        dep = wait_for(lambda: (d := team.get("/deployments/twin"))["ready_replicas"] == 2 and d,
                       timeout=START)  # fmt: skip
        urls = [r["url"] for r in dep["replica_list"]]
        oa = openai.OpenAI(base_url=sqlite_server.url + "/v1", api_key=key, max_retries=0)
        answers: list = []
        long = {"max_tokens": 600, "extra_body": {"ignore_eos": True}}
        sender = threading.Thread(
            target=lambda: answers.append(oa.completions.create(model="twin", prompt="x", **long))
        )
        sender.start()
        busy = wait_for(lambda: next((u for u in urls if _running(u)), None), timeout=60)
        _serve_process(int(busy.rsplit(":", 1)[1])).kill()
        sender.join(timeout=START)
        assert answers and answers[0].usage.completion_tokens == 600
        [other] = [u for u in urls if u != busy]
        assert _served(other, "length") == 1

        texts = []
        with pytest.raises(openai.APIError, match="replica failed mid-stream") as broken:
            for chunk in oa.completions.create(model="twin", prompt="y", stream=True, **LONG):
                texts.append(chunk.choices[0].text)
                if len(texts) == 1:
                    _serve_process(int(other.rsplit(":", 1)[1])).kill()
        assert texts and broken.value.body["code"] == "replica_failed"
        wait_for(lambda: all(r["restarts"] for r in team.get("/deployments/twin")["replica_list"]),
                 timeout=60)  # fmt: skip
    finally:
        team.delete("/deployments/twin")
        wait_for(lambda: team.get("/deployments") == [], timeout=30)


def _running(replica_url: str) -> float:
    """Sequences a replica runs now (0 if it does not answer)."""
    try:
        text = httpx.get(replica_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "gpucloud_serve_num_requests_running"
    )
