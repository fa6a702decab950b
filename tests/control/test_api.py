"""The REST API against a real server: auth, roles, tenant isolation, quotas, audit,
validation, OpenAPI and metrics."""

from __future__ import annotations

import itertools
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from http_wire import read_until_closed

from gpucloud.control.client import Client
from gpucloud.control.errors import AuthError, ConflictError, ForbiddenError
from gpucloud.errors import CapacityError, NotFoundError, UserError

from .conftest import REQUEST_TIMEOUT, wait_for, wait_state

_names = itertools.count()


def _tenant(server, prefix: str) -> Client:
    return server.tenant(f"{prefix}-{next(_names)}")


def _sleeper(name: str = "s", gpus: int = 1, seconds: float = 30) -> dict:
    return {"name": name, "command": f"sleep {seconds}", "gpus": gpus}


def _passes(http: httpx.Client, server) -> float:
    """How many reconciler passes the server has made."""
    metrics = http.get(server.url + "/metrics").text
    return float(re.search(r"^gpucloud_scheduling_pass_seconds_count (\S+)$", metrics, re.M)[1])


def test_requests_without_a_valid_key_are_401(shared_server):
    r = httpx.get(shared_server.url + "/api/v1/jobs")
    assert r.status_code == 401 and "Bearer" in r.json()["detail"]
    with pytest.raises(AuthError, match="invalid or revoked"):
        shared_server.client("gpc_not-a-key").get("/jobs")


def test_only_operators_manage_tenants_quotas_and_nodes(shared_server):
    team = _tenant(shared_server, "roles")
    with pytest.raises(ForbiddenError):
        team.post("/tenants", {"name": "sneaky"})
    with pytest.raises(ForbiddenError):
        team.put(f"/tenants/{team.get('/me')['tenant']}/quotas/L4", {"gpus": 99})
    node = team.get("/nodes")[0]["name"]
    with pytest.raises(ForbiddenError):
        team.post(f"/nodes/{node}/cordon")
    assert [t["name"] for t in team.get("/tenants")] == [team.get("/me")["tenant"]]


def test_viewer_reads_but_cannot_submit(shared_server):
    team = _tenant(shared_server, "viewers")
    viewer = shared_server.client(team.post("/users", {"name": "vic", "role": "viewer"})["api_key"])
    assert viewer.get("/me")["role"] == "viewer"
    assert viewer.get("/jobs") == []
    with pytest.raises(ForbiddenError, match="viewer"):
        viewer.post("/jobs", _sleeper())
    with pytest.raises(ForbiddenError):
        viewer.post("/users", {"name": "eve", "role": "admin"})


def test_another_tenants_objects_answer_404_on_every_endpoint(shared_server):
    alice, bob = _tenant(shared_server, "alice"), _tenant(shared_server, "bob")
    job = alice.post("/jobs", _sleeper(seconds=0.1))
    alice.post("/deployments", {"name": "web", "model_dir": "/m", "replicas": 0})
    alice_tenant = alice.get("/me")["tenant"]
    calls = [
        lambda: bob.get(f"/jobs/{job['id']}"),
        lambda: bob.get(f"/jobs/{job['id']}/logs"),
        lambda: bob.post(f"/jobs/{job['id']}/cancel"),
        lambda: bob.get("/deployments/web"),
        lambda: bob.post("/deployments/web/scale", {"replicas": 2}),
        lambda: bob.delete("/deployments/web"),
        lambda: bob.get(f"/tenants/{alice_tenant}"),
        lambda: bob.get("/usage", tenant=alice_tenant),
    ]
    for call in calls:
        with pytest.raises(NotFoundError):
            call()
    assert bob.get("/jobs") == [] and bob.get("/deployments") == []
    assert all(e["tenant"] == bob.get("/me")["tenant"] for e in bob.get("/audit"))
    # and alice still sees her own
    assert alice.get(f"/jobs/{job['id']}")["name"] == "s"
    assert alice.get("/deployments/web")["replicas"] == 0


def test_quota_rejects_jobs_that_can_never_fit_and_queues_the_rest(shared_server):
    admin = shared_server.client()
    team = _tenant(shared_server, "quota")
    name = team.get("/me")["tenant"]
    admin.put(f"/tenants/{name}/quotas/L4", {"gpus": 2})
    with pytest.raises(CapacityError, match="quota"):
        team.post("/jobs", _sleeper(gpus=3))
    first = team.post("/jobs", _sleeper("first", gpus=2))
    second = team.post("/jobs", _sleeper("second", gpus=1))
    wait_state(team, first["id"], "RUNNING")
    # 2 of the node's 4 GPUs are free, but the tenant is at its quota: the job waits
    why = wait_for(lambda: (j := team.get(f"/jobs/{second['id']}"))["reason"] and j)
    assert (why["state"], why["reason"]) == ("PENDING", "waiting for its tenant's quota")
    team.post(f"/jobs/{first['id']}/cancel")
    wait_state(team, second["id"], "RUNNING")
    team.post(f"/jobs/{second['id']}/cancel")
    wait_state(team, second["id"], "CANCELLED")
    assert any(e["action"] == "quota.set" for e in admin.get("/audit"))


def test_a_cohort_lends_idle_quota_and_takes_it_back_by_preempting_the_borrower(shared_server):
    """Kueue-style cohorts live: a tenant runs preemptible jobs on its cohort's idle quota;
    when the lender needs it, the scheduler preempts a borrowed job (requeued, not lost)."""
    admin = shared_server.client()
    lender, borrower = _tenant(shared_server, "lender"), _tenant(shared_server, "borrower")
    cohort = f"lab-{next(_names)}"
    for team in (lender, borrower):
        name = team.get("/me")["tenant"]
        admin.put(f"/tenants/{name}/quotas/L4", {"gpus": 2})
        assert admin.put(f"/tenants/{name}/cohort", {"cohort": cohort})["cohort"] == cohort
    jobs = [borrower.post("/jobs", {**_sleeper(f"b{i}"), "preemptible": True}) for i in range(3)]
    for job in jobs:
        wait_state(borrower, job["id"], "RUNNING")  # the third on the lender's idle quota
    # not preemptible: it could not be taken back, so it may not borrow
    pinned = borrower.post("/jobs", {**_sleeper("pinned"), "preemptible": False})
    why = wait_for(lambda: borrower.get(f"/jobs/{pinned['id']}")["reason"])
    assert why == "waiting for its tenant's quota"
    owned = lender.post("/jobs", _sleeper("owned", gpus=2))  # 1 GPU free: it reclaims one
    wait_state(lender, owned["id"], "RUNNING")
    rows = [borrower.get(f"/jobs/{j['id']}") for j in jobs]
    assert [(r["state"], r["preemptions"]) for r in rows] == [
        ("RUNNING", 0),
        ("RUNNING", 0),
        ("PENDING", 1),  # the youngest borrower's job
    ]
    preempted = [(e["to_state"], e["reason"]) for e in rows[2]["events"]][-2:]
    lender_name = lender.get("/me")["tenant"]
    assert preempted == [
        ("PREEMPTED", f"reclaimed: tenant {lender_name} needs its lent quota back"),
        ("PENDING", "requeued after preemption"),
    ]
    assert borrower.get(f"/jobs/{pinned['id']}")["state"] == "PENDING"
    for team, job in [(lender, owned), (borrower, pinned), *((borrower, j) for j in jobs)]:
        team.post(f"/jobs/{job['id']}/cancel")
    for job in jobs:
        wait_state(borrower, job["id"], "CANCELLED")
    with pytest.raises(UserError, match="cohort"):
        admin.put(f"/tenants/{lender.get('/me')['tenant']}/cohort", {"cohort": "no spaces"})


def test_jobs_given_shares_of_a_gpu_share_one_device_and_count_as_shares(shared_server):
    """gpus: 0.5 live, on the node's two GPUs a 2-GPU job leaves free: two halves share one
    device (both RUNNING, the same device), the third half goes to the other device, and a
    whole-GPU job waits; each half is told its share, and quota counts it as half a GPU."""
    admin = shared_server.client()
    team = _tenant(shared_server, "halves")
    name = team.get("/me")["tenant"]
    admin.put(f"/tenants/{name}/quotas/L4", {"gpus": 4})  # 2 + 3 halves: only as halves
    two = wait_state(team, team.post("/jobs", _sleeper("two", gpus=2))["id"], "RUNNING")
    probe = "echo $GPUCLOUD_DEVICES $GPUCLOUD_GPU_MEMORY_FRACTION; sleep 30"
    halves = [team.post("/jobs", {"name": f"half{i}", "command": probe, "gpus": 0.5})
              for i in range(3)]  # fmt: skip
    rows = [wait_state(team, h["id"], "RUNNING") for h in halves]
    assert [r["gpus"] for r in rows] == [0.5, 0.5, 0.5]
    (a,), (b,), (c,) = (r["devices"] for r in rows)
    assert a == b != c and not {a, c} & set(two["devices"])
    for row, device in zip(rows, (a, b, c), strict=True):
        log = wait_for(lambda row=row: team.get(f"/jobs/{row['id']}/logs"))
        assert log == f"{device} 0.5\n"
    assert admin.get("/nodes")[0]["gpus_allocated"] == 3.5
    whole = team.post("/jobs", _sleeper("whole"))
    reason = lambda: team.get(f"/jobs/{whole['id']}")["reason"]  # noqa: E731
    assert wait_for(lambda: reason() == "waiting for its tenant's quota")  # 4.5 > 4
    admin.put(f"/tenants/{name}/quotas/L4", {"gpus": 8})
    assert wait_for(lambda: reason() == "waiting for free GPUs")  # none is whole
    assert team.get(f"/jobs/{whole['id']}")["state"] == "PENDING"
    for job in (whole, two, *halves):
        team.post(f"/jobs/{job['id']}/cancel")
    for job in (whole, two, *halves):
        wait_state(team, job["id"], "CANCELLED")
    with pytest.raises(UserError, match="0.33 GPUs: give a whole number of GPUs, or a share"):
        team.post("/jobs", _sleeper(gpus=0.33))


def test_more_gpus_than_the_cluster_has_is_409_naming_what_exists(shared_server):
    team = _tenant(shared_server, "big")
    with pytest.raises(CapacityError, match="4 x L4"):
        team.post("/jobs", _sleeper(gpus=64))
    with pytest.raises(CapacityError, match="H100-SXM"):
        team.post("/jobs", {**_sleeper(), "gpu_type": "H100"})
    node = team.get("/nodes")[0]
    # the node offers what the machine has: the cores this process may use, its memory
    assert node["cpus"] == len(os.sched_getaffinity(0))
    assert node["memory_gib"] == pytest.approx(psutil.virtual_memory().total / 2**30, abs=1e-3)
    with pytest.raises(CapacityError, match=rf"largest node .* has {node['cpus']:g} CPUs"):
        team.post("/jobs", {**_sleeper(), "cpus": node["cpus"] + 0.5})
    with pytest.raises(CapacityError, match="GiB of memory"):
        team.post("/deployments", {"name": "d", "model_dir": "/m", "memory_gib": 10**6})


def test_more_replicas_than_the_cluster_or_quota_can_hold_is_409_saying_how_many(shared_server):
    """On create (replicas, or max_replicas when autoscaled) and on scale; the cluster is one
    node of 4 GPUs."""
    admin = shared_server.client()
    team = _tenant(shared_server, "replicas")
    dep = {"name": "d", "model_dir": "/m", "replicas": 0}
    with pytest.raises(CapacityError, match=r"^256 replicas .* at most 4 \(4 x L4\)"):
        team.post("/deployments", {**dep, "replicas": 256})
    with pytest.raises(CapacityError, match=r"^3 replicas of 2 GPUs .* at most 2 "):
        team.post("/deployments", {**dep, "replicas": 3, "gpus_per_replica": 2})
    with pytest.raises(CapacityError, match=r"^5 replicas .* at most 4"):
        team.post("/deployments", {**dep, "autoscale": {"max_replicas": 5}})
    cpus = admin.get("/nodes")[0]["cpus"]
    with pytest.raises(CapacityError, match=r"^3 replicas .* at most 2 .*CPUs"):
        team.post("/deployments", {**dep, "replicas": 3, "cpus": cpus / 2})
    team.post("/deployments", {**dep, "replicas": 0})
    with pytest.raises(CapacityError, match=r"^5 replicas .* at most 4"):
        team.post("/deployments/d/scale", {"replicas": 5})
    admin.put(f"/tenants/{team.get('/me')['tenant']}/quotas/L4", {"gpus": 3})
    with pytest.raises(CapacityError, match=r"^2 replicas of 2 GPUs .* quota .* at most 1"):
        team.post("/deployments", {**dep, "name": "e", "replicas": 2, "gpus_per_replica": 2})
    with pytest.raises(CapacityError, match=r"^4 replicas .*quota.* at most 3"):
        team.post("/deployments/d/scale", {"replicas": 4})
    assert team.post("/deployments/d/scale", {"replicas": 0})["replicas"] == 0
    assert team.get("/deployments/d")["replicas"] == 0
    assert [d["name"] for d in team.get("/deployments")] == ["d"]


def test_bad_specs_are_rejected_with_the_field_named(shared_server):
    team = _tenant(shared_server, "bad")
    with pytest.raises(UserError, match="comand"):
        team.post("/jobs", {"name": "x", "comand": "true"})
    with pytest.raises(UserError, match="exactly one of 'command' or 'train'"):
        team.post("/jobs", {"name": "x"})
    with pytest.raises(UserError, match="gpu_type: .*unknown GPU type 'H1OO'"):
        team.post("/jobs", {**_sleeper(), "gpu_type": "H1OO"})
    with pytest.raises(UserError, match="cpus: .*greater than or equal to 0"):
        team.post("/jobs", {**_sleeper(), "cpus": -1})
    with pytest.raises(UserError, match="memory_gib: .*valid number"):
        team.post("/jobs", {**_sleeper(), "memory_gib": "16G"})
    with pytest.raises(ConflictError):
        shared_server.client().post("/tenants", {"name": team.get("/me")["tenant"]})


def test_cordoned_node_takes_no_new_work(shared_server):
    admin = shared_server.client()
    team = _tenant(shared_server, "cordon")
    node = admin.get("/nodes")[0]["name"]
    assert admin.post(f"/nodes/{node}/cordon")["state"] == "cordoned"
    try:
        job = team.post("/jobs", _sleeper(seconds=0.1))
        wait_state(team, job["id"], "PENDING")
        with httpx.Client() as http:
            first = _passes(http, shared_server)
            wait_for(lambda: _passes(http, shared_server) >= first + 3)  # several passes
        assert team.get(f"/jobs/{job['id']}")["state"] == "PENDING"
    finally:
        admin.post(f"/nodes/{node}/uncordon")
    wait_state(team, job["id"], "SUCCEEDED")


def test_openapi_docs_and_metrics(shared_server):
    schema = httpx.get(shared_server.url + "/openapi.json").json()
    for path in (
        "/api/v1/jobs",
        "/api/v1/jobs/{job_id}/logs",
        "/api/v1/jobs/{job_id}/cancel",
        "/api/v1/deployments",
        "/api/v1/nodes",
        "/api/v1/tenants",
        "/api/v1/usage",
    ):
        assert path in schema["paths"]
    assert httpx.get(shared_server.url + "/docs").status_code == 200
    shared_server.client().get("/jobs")
    metrics = httpx.get(shared_server.url + "/metrics").text
    for name in (
        "gpucloud_jobs{",
        "gpucloud_queue_length",
        "gpucloud_gpus_total{",
        "gpucloud_scheduling_pass_seconds_count",
        "gpucloud_api_request_seconds_count{",
    ):
        assert name in metrics
    assert 'route="/api/v1/jobs"' in metrics


def test_control_plane_never_imports_torch():
    code = (
        "import sys\n"
        "from gpucloud.control import app, server, reconciler, client\n"
        "import gpucloud.cli.main\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_local_nodes_heartbeat_advances(shared_server):
    client = shared_server.client()
    first = client.get("/nodes")[0]["heartbeat_at"]
    # Written every third of the node timeout (30 s): up to 10 s from now, and a pass late.
    wait_for(lambda: client.get("/nodes")[0]["heartbeat_at"] > first, timeout=25)


def test_a_request_that_never_arrives_whole_gets_408(shared_server):
    host, port = shared_server.url.removeprefix("http://").split(":")
    started = time.monotonic()  # before the connection, whose accept starts the server's clock
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"GET /api/v1/nodes HTTP/1.1\r\nHost: x\r\n")  # head never finished
        reply = read_until_closed(conn)  # the server closes the connection after the 408
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert REQUEST_TIMEOUT <= time.monotonic() - started < 5 * REQUEST_TIMEOUT


def test_nul_bytes_and_bad_env_names_are_refused_at_submit_naming_the_field(shared_server):
    """A value no process can be started with is refused when submitted, on both stores
    (today SQLite took it and the job was retried for ever): a NUL anywhere with 400 before
    routing, an env name no process can have with 422; each names where it was."""
    team = _tenant(shared_server, "nul")
    job, dep = _sleeper(), {"name": "d", "model_dir": "/m", "replicas": 0}
    nul = [
        ("/jobs", {**job, "command": "sleep\x001"}, "at command "),
        ("/jobs", {**job, "command": ["sleep", "1\x00"]}, "at command.1 "),
        ("/jobs", {**job, "env": {"A\x00B": "1"}}, "at env (a key) "),
        ("/jobs", {**job, "env": {"A": "1\x00"}}, "at env.A "),
        ("/jobs", {**job, "workdir": "/tmp/\x00"}, "at workdir "),
        ("/jobs", {**job, "checkpoint_dir": "/tmp/\x00"}, "at checkpoint_dir "),
        ("/jobs", {"name": "t", "train": "run.toml\x00"}, "at train "),
        ("/jobs", {**job, "name": "a\x00b"}, "at name "),
        ("/deployments", {**dep, "model_dir": "/m\x00"}, "at model_dir "),
        ("/deployments", {**dep, "name": "d\x00"}, "at name "),
        ("/deployments", {**dep, "engine_args": ["--x\x00"]}, "at engine_args.0 "),
        ("/deployments", {**dep, "command": "serve\x00"}, "at command "),
        ("/deployments", {**dep, "env": {"X": "\x00"}}, "at env.X "),
    ]
    bad_names = [
        ("/jobs", {**job, "env": {"A=B": "1"}}, "env"),
        ("/jobs", {**job, "env": {"": "1"}}, "env"),
        ("/deployments", {**dep, "env": {"X=1": "y"}}, "env"),
    ]
    with httpx.Client(base_url=shared_server.url + "/api/v1", headers=team._http.headers) as http:
        for path, body, where in nul:
            r = http.post(path, json=body)
            assert r.status_code == 400, (body, r.text)
            assert where + "holds a NUL character" in r.json()["detail"], (body, r.text)
        for path, body, field in bad_names:
            r = http.post(path, json=body)
            assert r.status_code == 422, (body, r.text)
            named = [".".join(map(str, e["loc"][1:])) for e in r.json()["detail"]]
            assert any(n == field or n.startswith(field + ".") for n in named), (body, named)
        assert http.get("/jobs").json() == [] and http.get("/deployments").json() == []
        assert http.post("/jobs", json={**job, "env": {"_OK_1": "fine"}}).status_code == 201


def test_submissions_arriving_together_each_get_their_own_answer(shared_server):
    """Submissions that arrive together are committed together (db.GroupCommit): each
    still gets its own job, or its own error when it alone is refused."""
    admin = shared_server.client()
    key = admin.post("/tenants", {"name": f"burst-{next(_names)}"})["api_key"]
    headers = {"Authorization": f"Bearer {key}"}
    bodies = [_sleeper(f"b{i}", gpus=64 if i % 3 == 2 else 1) for i in range(12)]

    def submit(body: dict) -> httpx.Response:
        with httpx.Client(base_url=shared_server.url + "/api/v1", headers=headers) as http:
            return http.post("/jobs", json=body)

    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(submit, bodies))
    team = shared_server.client(key)
    try:
        for body, r in zip(bodies, answers, strict=True):
            if body["gpus"] == 64:
                assert r.status_code == 409 and "4 x L4" in r.json()["detail"], r.text
            else:
                job = r.json()
                assert r.status_code == 201 and job["name"] == body["name"], r.text
                assert [e["reason"] for e in job["events"]] == ["submitted"]
        accepted = {r.json()["id"]: r.json()["name"] for r in answers if r.status_code == 201}
        assert len(accepted) == 8
        assert {j["id"]: j["name"] for j in team.get("/jobs")} == accepted
        submits = [e for e in team.get("/audit") if e["action"] == "job.submit"]
        assert sorted(e["target"] for e in submits) == sorted(f"job/{i}" for i in accepted)
    finally:
        for r in answers:
            if r.status_code == 201:
                team.post(f"/jobs/{r.json()['id']}/cancel")
