"""The /v1 gateway with the real `openai` client: a tenant's deployments by name, routed
over their ready replicas of the real `gpucloud serve` by prompt prefix within a load bound,
streams relayed and dropped ones aborted on the replica (or ended by an error event when
the replica dies), other tenants' deployments invisible, errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from gpucloud.control import executors, server
from gpucloud.control.auth import authenticate
from gpucloud.control.config import Settings
from gpucloud.control.errors import ConflictError
from gpucloud.control.gateway import ROUTE_REFRESH, ROUTE_TTL, Gateway
from gpucloud.control.lifecycle import ReplicaState
from gpucloud.control.metrics import Metrics
from gpucloud.control.models import Replica
from gpucloud.control.schemas import DeploymentSpec
from gpucloud.control.services import deployments
from gpucloud.control.traffic import sticky_bucket
from gpucloud.errors import UserError
from gpucloud.eval.endpoint import EndpointBackend

from .conftest import GPUCLOUD, wait_for
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


def _gateway_count(server, deployment: str, status: str, tenant: str = "gateway") -> float:
    """Requests of `tenant`'s `deployment` the gateway answered with `status` (other tests
    on the session's server have deployments of the same names)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "gpucloud_gateway_requests_total"
        and (s.labels["tenant"], s.labels["deployment"], s.labels["status"])
        == (tenant, deployment, status)
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

    # vLLM's tokenize and detokenize, relayed by `model` as completions are
    auth = {"Authorization": f"Bearer {key}"}
    said = httpx.post(server.url + "/v1/tokenize", json={"model": "gw", "prompt": SYSTEM},
                      headers=auth, timeout=30)  # fmt: skip
    assert said.json() == httpx.post(urls[0] + "/tokenize", json={"prompt": SYSTEM}).json()
    back = httpx.post(server.url + "/v1/detokenize", headers=auth, timeout=30,
                      json={"model": "gw", "tokens": said.json()["tokens"]})  # fmt: skip
    assert back.status_code == 200 and back.json()["prompt"].endswith(SYSTEM)
    # so `gpucloud eval` finds them there: perplexity through the gateway is the replica's
    through, direct = EndpointBackend(server.url, "gw", key), EndpointBackend(urls[0])
    assert through.text_logprobs([SYSTEM]) == direct.text_logprobs([SYSTEM])
    through.close(), direct.close()


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


def test_a_route_in_use_is_read_again_in_the_background(db_url, tmp_path):
    """A route older than ROUTE_REFRESH is answered from memory (the request does not wait
    for the store) and read again beside it: what the store said meanwhile (a replica now
    READY) is routed from then on. One past ROUTE_TTL is read before it is used."""
    settings = Settings(home=tmp_path, db_url=db_url, virtual_gpus=2, node_name="n1")
    store, key = server.prepare(settings, executors.create(settings))
    gateway = Gateway(store, Metrics(store))

    def second_replica(state: ReplicaState) -> None:
        with store.transaction() as s:
            s.scalars(select(Replica).where(Replica.index == 1)).one().state = state

    async def exercise() -> None:
        first = await gateway.route(key, "d")
        assert len(first.replicas) == 1
        second_replica(ReplicaState.READY)
        assert await gateway.route(key, "d") is first and not gateway._refreshing
        await asyncio.sleep(ROUTE_REFRESH)
        assert await gateway.route(key, "d") is first
        [refresh] = gateway._refreshing.values()
        assert len((await refresh).replicas) == 2 and not gateway._refreshing
        assert len((await gateway.route(key, "d")).replicas) == 2
        second_replica(ReplicaState.FAILED)
        await asyncio.sleep(ROUTE_TTL)
        assert len((await gateway.route(key, "d")).replicas) == 1

    try:
        with store.transaction() as s:
            spec = DeploymentSpec(name="d", model_dir="/m", replicas=2)
            deployments.create(s, authenticate(s, key), spec)
            for port, r in enumerate(s.scalars(select(Replica).order_by(Replica.index)), 8001):
                r.url = f"http://127.0.0.1:{port}"
                r.state = ReplicaState.READY if port == 8001 else ReplicaState.STARTING
        asyncio.run(exercise())
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


# A canary that is up but answers every completion 500: the automatic rollback's target.
BROKEN_SERVER = """
import http.server, sys
class Broken(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.answer(200, b'{"status": "ok"}')
    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        self.answer(500, b'{"error": {"message": "broken", "type": "api_error"}}')
    def answer(self, status, body):
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Broken).serve_forever()
"""


def test_canary_rollout_rollback_promote_and_automatic_rollback(sqlite_server, tiny_model_dir):
    """Versions of one deployment: a canary takes its share of the requests (a `user` sticks
    to one version), is rolled back and another promoted while a client keeps sending
    requests (none fails: the version that ends drains), and a canary that answers 500s is
    rolled back by the control plane, which says why in the deployment's history."""
    key = sqlite_server.client().post("/tenants", {"name": "gateway-canary"})["api_key"]
    team = sqlite_server.client(key)
    team.post("/deployments", {"name": "ver", "model_dir": str(tiny_model_dir), "replicas": 1,
                               "engine_args": ENGINE_ARGS})  # fmt: skip
    try:
        _versions(sqlite_server, team, key, str(tiny_model_dir))
    finally:
        team.delete("/deployments/ver")
        wait_for(lambda: team.get("/deployments") == [], timeout=30)


def _versions(server, team, key: str, model: str) -> None:
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)
    with pytest.raises(ConflictError, match="'ver' has no canary to promote"):
        team.post("/deployments/ver/promote")
    rolled = team.post("/deployments/ver/rollout", {"model_dir": model, "canary": 25,
                                                     "engine_args": ENGINE_ARGS})  # fmt: skip
    assert (rolled["version"], rolled["canary"]["number"]) == (1, 2)
    urls = _ready_versions(team, [1, 2])
    _complete_until(oa, lambda: _served(urls[2], "length") > 0)  # routes show the canary

    before = {v: _served(u, "length") for v, u in urls.items()}
    for _ in range(8):
        _complete(oa)
    assert {v: _served(u, "length") - before[v] for v, u in urls.items()} == {1: 6, 2: 2}
    sticky = 2 if sticky_bucket("ann") < 2500 else 1
    before = _served(urls[sticky], "length")
    for _ in range(6):
        _complete(oa, user="ann")
    assert _served(urls[sticky], "length") - before == 6

    with _requests_meanwhile(oa) as tally:
        team.post("/deployments/ver/rollback")  # by hand: the canary drains
        team.post("/deployments/ver/rollout", {"model_dir": model, "engine_args": ENGINE_ARGS,
                                                "canary": 50})  # fmt: skip
        shown = _cli(server, key, "deploy", "history", "ver").stdout  # while version 3 starts
        wait_for(lambda: 2 not in _live_versions(team), timeout=60, interval=0.05)
        _ready_versions(team, [1, 3])
        promoted = team.post("/deployments/ver/promote")  # the old stable version drains
        wait_for(lambda: _live_versions(team) == [3], timeout=60, interval=0.05)
    assert tally["errors"] == [] and tally["ok"] > 0
    assert (promoted["version"], promoted["canary"]) == (3, None)
    assert "rolled back by hand" in shown and "v1 75%, v2 25%" in shown

    broken = f"{shlex.quote(sys.executable)} -c {shlex.quote(BROKEN_SERVER)} {{port}}"
    team.post("/deployments/ver/rollout", {"model_dir": model, "command": broken, "canary": 50,
                                            "guard": {"min_requests": 4}})  # fmt: skip
    _ready_versions(team, [3, 4])
    _complete_until(oa, lambda: team.get("/deployments/ver")["canary"] is None)
    history = team.get("/deployments/ver/history")
    assert [(v["number"], v["state"]) for v in history["versions"]] == [
        (1, "retired"), (2, "rolled_back"), (3, "stable"), (4, "rolled_back")
    ]  # fmt: skip
    assert [(e["action"], e["traffic"]) for e in history["events"]] == [
        ("create", {"1": 100}), ("rollout", {"1": 75, "2": 25}), ("rollback", {"1": 100}),
        ("rollout", {"1": 50, "3": 50}), ("promote", {"3": 100}),
        ("rollout", {"3": 50, "4": 50}), ("rollback", {"3": 100}),
    ]  # fmt: skip
    auto = history["events"][-1]
    assert auto["user"] is None and auto["reason"].startswith(
        "automatic: canary error rate 100.0% vs stable 0.0% over the last 60 s"
    )
    assert history["versions"][3]["reason"] == auto["reason"]


def _cli(server, key: str, *args: str) -> subprocess.CompletedProcess:
    env = {**server.env, "GPUCLOUD_API_KEY": key, "COLUMNS": "200"}
    return subprocess.run([GPUCLOUD, *args], env=env, capture_output=True, text=True,
                          check=True, timeout=60)  # fmt: skip


def _complete(oa: openai.OpenAI, **kw) -> None:
    oa.completions.create(model="ver", prompt="x", max_tokens=2,
                          extra_body={"ignore_eos": True}, **kw)  # fmt: skip


def _complete_until(oa: openai.OpenAI, done, tries: int = 200) -> None:
    """Send completions (some may fail: a broken canary's) until `done()`."""
    for _ in range(tries):
        with contextlib.suppress(openai.InternalServerError):
            _complete(oa)
        if done():
            return
    raise AssertionError(f"not {done} after {tries} requests")


def _live_versions(team) -> list[int]:
    return sorted({r["version"] for r in team.get("/deployments/ver")["replica_list"]})


def _ready_versions(team, numbers: list[int]) -> dict[int, str]:
    """Once each version in `numbers` has a ready replica: their URLs by version."""

    def ready():
        reps = team.get("/deployments/ver")["replica_list"]
        urls = {r["version"]: r["url"] for r in reps if r["state"] == "READY"}
        return sorted(urls) == numbers and urls

    return wait_for(ready, timeout=START)


@contextlib.contextmanager
def _requests_meanwhile(oa: openai.OpenAI) -> Iterator[dict]:
    """Completions sent one after another (20 a second at most) from a thread while the
    block runs: how many were answered, and the errors of the others."""
    tally: dict = {"ok": 0, "errors": []}
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                _complete(oa)
                tally["ok"] += 1
            except openai.OpenAIError as e:
                tally["errors"].append(e)
            stop.wait(0.05)  # steady, light load: replicas start meanwhile on these cores

    sender = threading.Thread(target=loop)
    sender.start()
    try:
        yield tally
    finally:
        stop.set()
        sender.join(timeout=START)
