"""The web console over plain HTTP: its session, and the API's own authorization."""

from __future__ import annotations

import json
import os
import uuid
from html import unescape

import httpx
import pytest
from control.conftest import wait_state

from console.conftest import login
from gpucloud.control.console import sessions, views

SLEEPER = "sleep 60"


@pytest.fixture
def tenants(shared_server):
    """Two new tenants of the shared server (their keys), and a job of the second."""
    keys = []
    for _ in range(2):
        created = shared_server.client().post("/tenants", {"name": f"con-{uuid.uuid4().hex[:8]}"})
        keys.append(created["api_key"])
    b = shared_server.client(keys[1])
    job_b = b.post("/jobs", {"name": "secret-b", "command": SLEEPER})
    yield keys[0], keys[1], job_b
    b.post(f"/jobs/{job_b['id']}/cancel")


def test_a_tenant_cannot_see_another_tenants_job(shared_server, tenants):
    a, _b, job_b = tenants
    http = login(shared_server, a)
    for path in ("", "/log", "/curves"):
        response = http.get(f"/console/jobs/{job_b['id']}{path}")
        assert response.status_code == 404, (path, response.text)
        assert response.json()["detail"] == f"no job {job_b['id']}"
    refused = http.post(f"/console/jobs/{job_b['id']}/cancel")
    assert refused.status_code == 404
    assert f"no job {job_b['id']}" in refused.text
    assert refused.headers["hx-retarget"] == "#alerts"
    listing = http.get("/console/jobs").text
    assert "secret-b" not in listing
    queues = http.get("/console/queues").text
    assert "secret-b" not in queues


def test_the_session_cookie_is_an_opaque_id_and_logout_ends_it(shared_server, tenants):
    a, _b, _job = tenants
    http = httpx.Client(base_url=shared_server.url, timeout=10)
    response = http.post("/console/login", data={"key": a})
    assert response.status_code == 303
    assert response.headers["location"] == "/console/"  # no key in any URL
    cookie = response.headers["set-cookie"]
    assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()
    assert "path=/console" in cookie.lower()
    session_id = http.cookies["gpucloud_session"]
    assert a not in cookie and a[4:20] not in session_id and len(session_id) >= 40
    for page in ("/console/", "/console/queues", "/console/jobs", "/console/deployments",
                 "/console/usage", "/console/simulator"):  # fmt: skip
        shown = http.get(page)
        assert shown.status_code == 200 and a not in shown.text, page
        assert a not in str(shown.headers), page
    out = http.post("/console/logout")
    assert out.status_code == 303 and out.headers["location"] == "/console/login"
    assert http.get("/console/jobs").headers["location"] == "/console/login"
    http.cookies.set("gpucloud_session", session_id, path="/console")  # kept by a thief
    assert http.get("/console/jobs").headers["location"] == "/console/login"


def test_a_revoked_or_rotated_key_ends_its_sessions(shared_server, tenants):
    a, _b, _job = tenants
    admin = shared_server.client(a)
    tenant = admin.get("/me")["tenant"]
    for how in ("revoke", "rotate"):
        key = admin.post(f"/tenants/{tenant}/keys", {"name": f"web-{how}"})["api_key"]
        http = login(shared_server, key)
        assert http.get("/console/jobs").status_code == 200
        if how == "revoke":
            admin.delete(f"/tenants/{tenant}/keys/web-{how}")
        else:  # the old key still works on the API for its grace period, not in the console
            new = admin.post(f"/tenants/{tenant}/keys/web-{how}/rotate", {"grace_seconds": 3600})
            assert shared_server.client(key).get("/me")["tenant"] == tenant
            refused = httpx.post(f"{shared_server.url}/console/login", data={"key": key})
            assert refused.status_code == 401 and "was rotated" in refused.text
            assert login(shared_server, new["api_key"]).get("/console/").status_code == 200
        assert http.get("/console/jobs").headers["location"] == "/console/login", how


def test_without_a_working_key_every_page_leads_to_the_login(shared_server):
    http = httpx.Client(base_url=shared_server.url, timeout=10)
    assert http.get("/").headers["location"] == "/console/"
    for page in ("/console/", "/console/jobs", "/console/usage", "/console/simulator"):
        response = http.get(page)
        assert response.status_code == 303 and response.headers["location"] == "/console/login"
    polled = http.get("/console/jobs", headers={"HX-Request": "true"})
    assert polled.headers["hx-redirect"] == "/console/login"
    bad = http.post("/console/login", data={"key": "gpc_not-a-key"})
    assert bad.status_code == 401
    assert "invalid or revoked API key" in bad.text
    http.cookies.set("gpucloud_session", "gpc_revoked", path="/console")
    assert http.get("/console/").headers["location"] == "/console/login"


def test_an_operator_sees_every_tenants_jobs_and_deployments_a_tenant_its_own(
    shared_server, tenants
):
    a, b, job_b = tenants
    tenant_a, tenant_b = shared_server.client(a).get("/me")["tenant"], job_b["tenant"]
    spec = {"name": "b-web", "model_dir": "/m", "replicas": 0, "command": "sleep 60"}
    shared_server.client(b).post("/deployments", spec)
    try:
        operator = login(shared_server, shared_server.admin_key)
        everyone = operator.get("/console/jobs").text
        assert "secret-b" in everyone and tenant_b in everyone
        assert f'<option value="{tenant_a}">' in everyone  # the tenant filter
        assert f"/console/jobs/{job_b['id']}" not in everyone  # its page is b's alone
        assert "secret-b" not in operator.get(f"/console/jobs?tenant={tenant_a}").text
        deployments = operator.get("/console/deployments").text
        assert "b-web" in deployments and f"of {tenant_b}" in deployments
        assert "Replicas of b-web" not in deployments  # scaled by its tenant only
        assert "b-web" not in operator.get(f"/console/deployments?tenant={tenant_a}").text
        series = operator.get("/console/deployments/series").json()["deployments"]
        assert ("b-web", tenant_b) in {(d["name"], d["tenant"]) for d in series}

        tenant_view = login(shared_server, a)
        assert "b-web" not in tenant_view.get("/console/deployments").text
        assert 'name="tenant"' not in tenant_view.get("/console/jobs").text
        assert tenant_view.get("/console/deployments/series").json() == {"deployments": []}
        for page in ("/console/jobs", "/console/queues", "/console/deployments"):
            refused = tenant_view.get(page, params={"tenant": tenant_b})
            assert refused.status_code == 404 and refused.json()["detail"] == (
                f"no tenant {tenant_b!r}"
            )
    finally:
        shared_server.client(b).delete("/deployments/b-web")


def test_the_month_shows_each_tenants_usage_by_day_against_quota_and_budget(shared_server, tenants):
    a, _b, job_b = tenants
    admin, team_a = shared_server.client(), shared_server.client(a)
    tenant_a = team_a.get("/me")["tenant"]
    gpu_type = admin.get("/nodes")[0]["gpu_type"]
    admin.put(f"/tenants/{tenant_a}/quotas/{gpu_type}", {"gpus": 2})
    admin.put(f"/tenants/{tenant_a}/budgets", {"unit": "usd", "amount": 50})
    wait_state(shared_server.client(_b), job_b["id"], "RUNNING")  # b has usage now
    mine = login(shared_server, a).get("/console/usage/month").json()
    (t,) = mine["tenants"]
    assert t["tenant"] == tenant_a and t["budgets"] == {"usd": 50.0}
    days = len(mine["days"])
    assert 28 <= days <= 31 and len(t["quota_gpu_hours"]) == days
    assert t["quota_gpu_hours"][0] == 48.0 and t["quota_gpu_hours"][-1] == 48.0 * days
    assert 1 <= len(t["gpu_hours"]) == len(t["cost"]) <= days
    everyone = login(shared_server, shared_server.admin_key).get("/console/usage/month").json()
    b = next(x for x in everyone["tenants"] if x["tenant"] == job_b["tenant"])
    assert b["gpu_hours"][-1] > 0 and b["cost"][-1] > 0 and b["quota_gpu_hours"] is None


def test_a_request_from_another_site_is_refused(shared_server, tenants):
    a, _b, _job = tenants
    http = login(shared_server, a)
    form = {"name": "x", "command": "true"}
    response = http.post("/console/jobs", data=form, headers={"Origin": "http://evil.example"})
    assert response.status_code == 403
    assert "cross-site request from http://evil.example refused" in response.text


def test_bad_form_input_gets_a_one_line_alert(shared_server, tenants):
    a, _b, _job = tenants
    http = login(shared_server, a)
    response = http.post("/console/jobs", data={"name": "ok", "command": "true", "gpus": "0"})
    assert response.status_code == 400
    assert "gpus: 0 GPUs: give a whole number of GPUs, or a share of one GPU" in response.text
    scaled = http.post("/console/deployments/none/scale", data={"replicas": "many"})
    assert scaled.status_code == 400
    assert "replicas must be a whole number from 0 to 256, got 'many'" in unescape(scaled.text)
    missing = http.post("/console/deployments/none/scale", data={"replicas": "1"})
    assert missing.status_code == 404 and "no deployment 'none'" in unescape(missing.text)
    sim = http.post("/console/simulator", params={"policy": "nope", "example": "busy"})
    assert sim.status_code == 400
    assert sim.json()["detail"].startswith("unknown policy 'nope': choose one of")


def test_the_allocation_map_names_only_the_callers_own_tenant(shared_server, tenants):
    a, b, job_b = tenants
    wait_state(shared_server.client(b), job_b["id"], "RUNNING")
    tenant_view = login(shared_server, a).get("/console/").text
    assert views.OTHER in tenant_view
    assert job_b["tenant"] not in tenant_view
    admin_view = login(shared_server, shared_server.admin_key).get("/console/").text
    assert job_b["tenant"] in admin_view


def test_curves_read_metrics_records_and_skip_events_and_symlinks(tmp_path):
    lines = [
        {"step": 1, "loss": 2.5, "tokens_per_s": 100.0, "grad_norm": 1.0},
        {"event": "rollback", "step": 1},
        {"step": 2, "loss": None, "tokens_per_s": 110.0},
    ]
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps(x) for x in lines) + '\n{"step": 3, "lo'
    )
    c = views.curves(tmp_path)
    assert c.step == [1, 2]
    assert c.series["loss"] == [2.5, None]
    assert c.series["tokens_per_s"] == [100.0, 110.0]
    assert c.series["grad_norm"] == [1.0, None]
    other = tmp_path / "other"
    other.mkdir()
    os.symlink(tmp_path / "metrics.jsonl", other / "metrics.jsonl")
    assert views.curves(other).step == []
    assert views.curves(None).step == []


def test_sessions_end_when_idle_or_old_and_stay_bounded(monkeypatch):
    now = [0.0]
    store = sessions.Sessions(clock=lambda: now[0])
    a = store.open("gpc_a")
    assert store.key(a) == "gpc_a" and store.key("made-up") is None
    now[0] = sessions.IDLE - 1
    assert store.key(a) == "gpc_a"  # a request restarts its idle time
    now[0] += sessions.IDLE
    assert store.key(a) is None
    b = store.open("gpc_b")
    for _ in range(int(sessions.LIFETIME // sessions.IDLE) + 1):
        now[0] += sessions.IDLE - 1
        store.key(b)
    assert store.key(b) is None  # busy, but past its lifetime
    monkeypatch.setattr(sessions, "MAX_SESSIONS", 3)
    ids = [store.open(f"gpc_{i}") for i in range(4)]
    assert len(store) == 3 and store.key(ids[0]) is None and store.key(ids[3]) == "gpc_3"
    store.end_key("gpc_3")
    assert store.key(ids[3]) is None and store.key(ids[2]) == "gpc_2"


def test_a_tenant_cannot_see_roll_out_promote_or_roll_back_another_tenants_deployment(
    shared_server, tenants
):
    a, b, _job = tenants
    spec = {"name": "b-chat", "model_dir": "/m", "replicas": 0, "command": "sleep 60"}
    owner = shared_server.client(b)
    owner.post("/deployments", spec)
    try:
        http = login(shared_server, a)
        page = http.get("/console/deployments/b-chat/versions")
        assert page.status_code == 404 and page.json()["detail"] == "no deployment 'b-chat'"
        for action, form in (("rollout", {"model_dir": "/m2", "canary": "50"}),
                             ("promote", {}), ("rollback", {})):  # fmt: skip
            refused = http.post(f"/console/deployments/b-chat/{action}", data=form)
            assert refused.status_code == 404, action
            assert "no deployment 'b-chat'" in unescape(refused.text), action
            assert refused.headers["hx-retarget"] == "#alerts"
        assert owner.get("/deployments/b-chat")["canary"] is None

        mine = login(shared_server, b)
        rollout = {"model_dir": "/m2", "canary": "50", "auto_rollback": "on"}
        forged = mine.post("/console/deployments/b-chat/rollout", data=rollout,
                           headers={"Origin": "http://evil.example"})  # fmt: skip
        assert forged.status_code == 403
        assert "cross-site request from http://evil.example refused" in forged.text
        assert owner.get("/deployments/b-chat")["canary"] is None
    finally:
        owner.delete("/deployments/b-chat")


def test_a_version_is_rolled_out_promoted_and_rolled_back_from_the_console(shared_server, tenants):
    _a, b, _job = tenants
    spec = {"name": "b-roll", "model_dir": "/m", "replicas": 0, "command": "sleep 60"}
    owner = shared_server.client(b)
    owner.post("/deployments", spec)
    try:
        http = login(shared_server, b)
        page = http.get("/console/deployments/b-roll/versions").text
        assert 'value="sleep 60"' in page  # the stable version's command, to keep or change
        for form, error in (
            ({"model_dir": "/m2", "canary": "0"}, "canary: input should be greater than 0"),
            ({"model_dir": "/m2", "engine_args": "--served-model-name x"},
             "--served-model-name is the deployment's name"),
            ({"model_dir": "/m2", "engine_args": "'open"}, "engine_args: No closing quotation"),
            ({"model_dir": "", "canary": "5"}, "model_dir"),
        ):  # fmt: skip
            refused = http.post("/console/deployments/b-roll/rollout", data=form)
            assert refused.status_code == 400 and error in unescape(refused.text), form
            assert unescape(refused.text).count("\n") <= 1, refused.text  # one line
        form = {"model_dir": "/m2", "canary": "50", "engine_args": "--max-num-seqs 8",
                "command": "sleep 61"}  # fmt: skip
        shown = unescape(http.post("/console/deployments/b-roll/rollout", data=form).text)
        assert "version 1 50% · canary version 2 50%" in shown
        assert "<code>--max-num-seqs 8</code>" in shown and "Promote version 2" in shown
        canary = owner.get("/deployments/b-roll")["canary"]
        assert canary["number"] == 2 and canary["command"] == "sleep 61"
        assert canary["guard"] is None  # the automatic rollback box was not ticked
        again = http.post("/console/deployments/b-roll/rollout", data=form)
        assert again.status_code == 409 and "already has a canary, version 2" in again.text
        shown = unescape(http.post("/console/deployments/b-roll/promote").text)
        assert "version 2 100%" in shown and "retired" in shown
        none = http.post("/console/deployments/b-roll/rollback")
        assert none.status_code == 409 and "has no canary to roll back" in unescape(none.text)
        http.post("/console/deployments/b-roll/rollout", data={**form, "auto_rollback": "on"})
        assert owner.get("/deployments/b-roll")["canary"]["guard"]["min_requests"] == 20
        shown = unescape(http.post("/console/deployments/b-roll/rollback").text)
        assert "rolled back by hand" in shown and "version 2 100%" in shown
        listing = unescape(http.get("/console/deployments").text)
        assert "version 2 100%" in listing and "/console/deployments/b-roll/versions" in listing
    finally:
        owner.delete("/deployments/b-roll")
