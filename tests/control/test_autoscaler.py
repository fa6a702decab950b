"""The autoscaler: its arithmetic, then real replicas that follow real load through the
/v1 gateway and shrink back once it is gone."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from gpucloud.control.autoscaler import WINDOW, Autoscaler
from gpucloud.control.lifecycle import ReplicaState
from gpucloud.control.models import Replica
from gpucloud.control.schemas import Autoscale
from gpucloud.control.warm_pool import arrange, kept
from gpucloud.errors import CapacityError, UserError

from .conftest import wait_for
from .test_deployments import ENGINE_ARGS, START


def test_grows_at_once_and_shrinks_only_after_the_delay():
    spec = Autoscale(min_replicas=1, max_replicas=4, target_in_flight=2, scale_down_delay=30)
    a = Autoscaler(gateway=None)
    assert a.wanted(1, spec, 1, 0, now=0.0) == 1  # floor
    assert a.wanted(1, spec, 1, 8, now=1.0) == 2  # average of 0 and 8 in flight over 2 = 2
    assert a.wanted(1, spec, 2, 8, now=WINDOW + 2) == 4  # only 8s left in the window
    assert a.wanted(1, spec, 4, 100, now=WINDOW + 3) == 4  # ceiling
    quiet = WINDOW + 3 + WINDOW + 1  # the window holds only idle samples from here
    assert a.wanted(1, spec, 4, 0, now=quiet) == 4  # it wanted 4 within the last 30 s
    assert a.wanted(1, spec, 4, 0, now=WINDOW + 3 + 30.5) == 1
    assert a.wanted(2, spec, 3, 5, now=0.0) == 3  # deployments are apart; 5 / 2 -> 3


def test_bad_autoscale_settings_name_the_field():
    with pytest.raises(ValueError, match="max_replicas must be >= min_replicas"):
        Autoscale(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="target_in_flight"):
        Autoscale(max_replicas=2, target_in_flight=0)


def test_a_scale_up_takes_a_warm_replica_first_and_a_scale_down_keeps_it_warm():
    starting = Replica(id=1, index=0, state=ReplicaState.STARTING)
    warm = Replica(id=2, index=1, state=ReplicaState.WARM)
    arrange([starting, warm], routed=1, kept_=2)  # 0 -> 1 routed, a pool of 1
    assert (warm.index, warm.state) == (0, ReplicaState.READY)  # loaded already: routed
    assert (starting.index, starting.state) == (1, ReplicaState.STARTING)  # now the pool's
    arrange([starting, warm], routed=0, kept_=1)  # back to 0: it waits in the pool again
    assert (warm.index, warm.state) == (0, ReplicaState.WARM) and starting.index == 1
    assert kept(2, "stable", 1) == 3 and kept(1, "canary", 1) == 1  # no pool for a canary


def test_replicas_follow_the_load_through_the_gateway(sqlite_server, tiny_model_dir):
    key = sqlite_server.client().post("/tenants", {"name": "autoscaled"})["api_key"]
    team = sqlite_server.client(key)
    dep = team.post("/deployments", {
        "name": "auto", "model_dir": str(tiny_model_dir), "engine_args": ENGINE_ARGS,
        "autoscale": {"max_replicas": 2, "target_in_flight": 2, "scale_down_delay": 2},
    })  # fmt: skip
    assert dep["replicas"] == 1 and dep["autoscale"]["min_replicas"] == 1
    team.post("/deployments", {"name": "fixed", "model_dir": "/m", "replicas": 0})  # not scaled
    try:
        with pytest.raises(UserError, match="autoscaled .*not set by hand"):
            team.post("/deployments/auto/scale", {"replicas": 2})
        wait_for(lambda: team.get("/deployments/auto")["ready_replicas"] == 1, timeout=START)
        oa = openai.OpenAI(base_url=sqlite_server.url + "/v1", api_key=key, max_retries=0)
        stop = threading.Event()

        def hold_a_stream() -> None:
            """One stream in flight until told to stop: a stream that ends (the tiny model
            writes 1,900 tokens in seconds) is followed by another, for on a loaded machine
            the second replica may take longer to start than a stream lasts."""
            while not stop.is_set():
                with oa.completions.create(model="auto", prompt="x", max_tokens=1900, stream=True,
                                           extra_body={"ignore_eos": True}) as stream:  # fmt: skip
                    for _ in stream:
                        if stop.is_set():
                            return

        load = [threading.Thread(target=hold_a_stream) for _ in range(4)]
        for t in load:
            t.start()
        try:  # 4 in flight at 2 per replica: a second replica, which then serves too
            wait_for(lambda: team.get("/deployments/auto")["ready_replicas"] == 2, timeout=START)
        finally:
            stop.set()
            for t in load:
                t.join(timeout=60)
        wait_for(lambda: team.get("/deployments/auto")["replicas"] == 1, timeout=60)
        done = oa.completions.create(model="auto", prompt="x", max_tokens=2)
        assert done.usage.completion_tokens == 2
        moves = [e["detail"] for e in team.get("/audit") if e["action"] == "deployment.autoscale"]
        assert moves[::-1] == [{"replicas": 2, "was": 1}, {"replicas": 1, "was": 2}]
        assert team.get("/deployments/fixed")["replicas"] == 0
    finally:
        team.delete("/deployments/auto")
        team.delete("/deployments/fixed")
        wait_for(lambda: team.get("/deployments") == [], timeout=30)


def test_scaled_to_zero_a_request_waits_for_a_replica(sqlite_server, tiny_model_dir):
    """min_replicas 0: no replica while idle; a request waits in the gateway while one
    starts and is served by it; idle again, the deployment goes back to zero. One that
    cannot start answers 503 with Retry-After once its bounded wait is over."""
    key = sqlite_server.client().post("/tenants", {"name": "to-zero"})["api_key"]
    team = sqlite_server.client(key)
    team.post("/deployments", {
        "name": "lazy", "model_dir": str(tiny_model_dir), "engine_args": ENGINE_ARGS,
        "replicas": 0, "autoscale": {"min_replicas": 0, "max_replicas": 1,
                                     "scale_down_delay": 1},
    })  # fmt: skip
    team.post("/deployments", {"name": "broken", "model_dir": "/nowhere", "replicas": 0,
                               "autoscale": {"min_replicas": 0, "max_replicas": 1,
                                             "max_cold_wait": 1}})  # fmt: skip
    oa = openai.OpenAI(base_url=sqlite_server.url + "/v1", api_key=key, max_retries=0,
                       timeout=START)  # fmt: skip
    try:
        assert team.get("/deployments/lazy")["replica_list"] == []
        done = oa.completions.create(model="lazy", prompt="x", max_tokens=2,
                                     extra_body={"ignore_eos": True})  # fmt: skip
        assert done.usage.completion_tokens == 2
        wait_for(lambda: team.get("/deployments/lazy")["replica_list"] == [], timeout=60)
        moves = [e["detail"] for e in team.get("/audit") if e["action"] == "deployment.autoscale"
                 and e["target"] == "deployment/lazy"]  # fmt: skip
        assert moves[::-1] == [{"replicas": 1, "was": 0}, {"replicas": 0, "was": 1}]
        with pytest.raises(openai.InternalServerError, match="waited 1 s for one to start") as e:
            oa.completions.create(model="broken", prompt="x", max_tokens=1)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
    finally:
        team.delete("/deployments/lazy")
        team.delete("/deployments/broken")
        wait_for(lambda: team.get("/deployments") == [], timeout=30)


def test_a_warm_replica_is_promoted_on_a_scale_up_from_zero(sqlite_server, tiny_model_dir):
    """--warm-pool 1 at min_replicas 0: one replica loaded but not routed (not ready
    capacity, and a request still waits for the autoscaler); the request promotes that very
    replica and the pool refills. A pool counts against capacity like any replica; an
    update empties it. (A scale-down back to the pool: the arrangement test above.)"""
    key = sqlite_server.client().post("/tenants", {"name": "warm"})["api_key"]
    team = sqlite_server.client(key)
    spec = {"name": "pooled", "model_dir": str(tiny_model_dir), "engine_args": ENGINE_ARGS,
            "replicas": 0, "warm_pool": 1, "autoscale": {"min_replicas": 0, "max_replicas": 1,
                                                         "scale_down_delay": 2}}  # fmt: skip
    with pytest.raises(CapacityError, match="5 replicas .* can never run at once here"):
        team.post("/deployments", {**spec, "warm_pool": 4})
    team.post("/deployments", spec)
    oa = openai.OpenAI(base_url=sqlite_server.url + "/v1", api_key=key, max_retries=0,
                       timeout=START)  # fmt: skip
    try:
        (warm,) = wait_for(lambda: _states(team, "WARM"), timeout=START)
        shown = team.get("/deployments/pooled")
        assert (shown["ready_replicas"], shown["warm_replicas"], shown["replicas"]) == (0, 1, 0)
        done = oa.completions.create(model="pooled", prompt="x", max_tokens=2,
                                     extra_body={"ignore_eos": True})  # fmt: skip
        assert done.usage.completion_tokens == 2
        replicas = team.get("/deployments/pooled")["replica_list"]
        assert (replicas[0]["id"], replicas[0]["state"]) == (warm["id"], "READY")
        assert len(replicas) == 2  # the pool refills behind it
        served = httpx.get(warm["url"] + "/metrics", timeout=10).text
        assert 'finished_reason="length"' in served  # it served the request
        moves = [e["detail"] for e in team.get("/audit") if e["action"] == "deployment.autoscale"]
        assert moves == [{"replicas": 1, "was": 0}]  # the request waited for the autoscaler
        team.patch("/deployments/pooled", {"warm_pool": 0})  # the refill stops
        wait_for(lambda: [r["id"] for r in _states(team, "READY")] == [warm["id"]], timeout=30)
    finally:
        team.delete("/deployments/pooled")
        wait_for(lambda: team.get("/deployments") == [], timeout=30)


def _states(team, state: str) -> list[dict]:
    """The deployment's replicas if all of them are in `state` (else [])."""
    replicas = team.get("/deployments/pooled")["replica_list"]
    return replicas if replicas and all(r["state"] == state for r in replicas) else []
