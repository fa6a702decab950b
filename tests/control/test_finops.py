"""Prices, showback and budgets against a real control plane (SQLite and PostgreSQL).

Prices are the whole cluster's: these tests share a server of their own, so the session's
shared server keeps the catalog's prices.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from gpucloud.control.client import Client
from gpucloud.control.errors import ForbiddenError
from gpucloud.errors import UserError

from . import fake_replica
from .conftest import GPUCLOUD, Server, wait_for, wait_state, workload_pids


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request, tmp_path_factory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("finops")
    if request.param == "sqlite":
        url = f"sqlite:///{home / 'state.db'}"
    else:
        url = request.getfixturevalue("postgres").new_database()
    srv = Server(url, home).start()
    yield srv
    srv.stop()


def _tenant(server: Server, name: str) -> tuple[Client, str]:
    """A new tenant's admin client and its key."""
    key = server.client().post("/tenants", {"name": name})["api_key"]
    return server.client(key), key


def _run(team: Client, name: str, seconds: float, **spec) -> dict:
    job = team.post("/jobs", {"name": name, "command": f"sleep {seconds}", **spec})
    return wait_state(team, job["id"], "SUCCEEDED")


def _line(team: Client, name: str) -> dict:
    return next(x for x in team.get("/usage")["lines"] if x["name"] == name)


def test_prices_are_versioned_and_usage_keeps_the_price_it_had(server):
    admin, team = server.client(), server.tenant("price-team")
    assert team.get("/prices") == []  # the catalog's prices, until an operator sets one
    with pytest.raises(ForbiddenError):
        team.post("/prices", {"gpu_type": "L4", "per_hour": 0.0})
    with pytest.raises(UserError, match="in the past"):
        admin.post("/prices", {"gpu_type": "L4", "per_hour": 1.0, "effective_from": 1e9})
    with pytest.raises(UserError, match="gpu_type"):
        admin.post("/prices", {"gpu_type": "L5", "per_hour": 1.0})
    first = admin.post("/prices", {"gpu_type": "l4", "per_hour": 2.0})
    assert first["gpu_type"] == "L4" and first["pool"] == ""
    before = _run(team, "before", 0.2)
    line = _line(team, "before")
    assert line["cost"] == pytest.approx(line["gpu_hours"] * 2.0)

    # a change while a job runs: its interval is priced in two pieces
    job = team.post("/jobs", {"name": "across", "command": "sleep 1.5"})
    running = wait_state(team, job["id"], "RUNNING")
    second = admin.post("/prices", {"gpu_type": "L4", "per_hour": 5.0})
    across = wait_state(team, job["id"], "SUCCEEDED")
    change = second["effective_from"]
    assert running["started_at"] < change < across["finished_at"]
    expected = (change - across["started_at"]) * 2.0 + (across["finished_at"] - change) * 5.0
    assert _line(team, "across")["cost"] == pytest.approx(expected / 3600, rel=1e-6)
    assert _line(team, "before") == line  # history is not rewritten
    assert before["finished_at"] < change

    versions = [p for p in team.get("/prices", gpu_type="L4")]
    assert [(p["per_hour"], p["effective_until"]) for p in versions] == [
        (2.0, change),
        (5.0, None),
    ]
    entries = [e for e in admin.get("/audit") if e["action"] == "price.set"]
    assert entries[0]["detail"]["per_hour"] == 5.0 and entries[0]["target"] == "price/L4"


def test_showback_groups_by_user_and_label_with_requested_hours(server):
    admin, key = _tenant(server, "show-team")
    bob = server.client(admin.post("/users", {"name": "bob"})["api_key"])
    _run(admin, "ml", 0.2, labels={"team": "ml"})
    _run(bob, "cv", 0.2, gpus=2, labels={"team": "cv"}, time_limit="1m")
    report = admin.get("/usage/showback", by="user,label:team")
    rows = {tuple(r["group"].values()): r for r in report["rows"]}
    assert set(rows) == {("admin", "ml"), ("bob", "cv")}  # no other tenant's usage
    cv = rows["bob", "cv"]
    assert cv["requested_gpu_hours"] == pytest.approx(2 * 60 / 3600)
    assert cv["waste_gpu_hours"] == pytest.approx(cv["requested_gpu_hours"] - cv["gpu_hours"])
    ml = rows["admin", "ml"]  # no time limit: nothing to compare with
    assert ml["requested_gpu_hours"] == ml["gpu_hours"] and ml["waste_gpu_hours"] == 0
    everyone = server.client().get("/usage/showback", by="tenant")["rows"]
    assert {"price-team", "show-team"} <= {r["group"]["tenant"] for r in everyone}
    with pytest.raises(UserError, match="'project' is not a dimension: use a list of tenant"):
        admin.get("/usage/showback", by="tenant,project")

    env = {**server.env, "GPUCLOUD_API_KEY": key}
    out = subprocess.run(
        [GPUCLOUD, "usage", "--by", "user,label", "--since", "1h", "--format", "csv"],
        env=env, capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    table = list(csv.DictReader(io.StringIO(out)))
    assert [(r["user"], r["label"]) for r in table] == [("bob", "team=cv"), ("admin", "team=ml")]
    assert float(table[0]["requested_gpu_hours"]) == pytest.approx(2 * 60 / 3600, abs=1e-6)


def test_a_budget_warns_then_holds_new_jobs_until_raised(server, tmp_path):
    admin, (team, key) = server.client(), _tenant(server, "budget-team")
    _run(team, "first", 0.3)
    spent = _line(team, "first")["gpu_hours"]
    budget = {"unit": "gpu_hours", "amount": spent / 0.9, "soft": 0.5}
    status = admin.put("/tenants/budget-team/budgets", budget)
    assert status["state"] == "warning" and status["fraction"] == pytest.approx(0.9)
    with pytest.raises(ForbiddenError):
        team.put("/tenants/budget-team/budgets", {**budget, "amount": 1000})

    second = team.post("/jobs", {"name": "second", "command": "sleep 0.3"})
    (warning,) = second["warnings"]
    assert warning.startswith("budget past 50%: tenant budget-team used ")
    wait_state(team, second["id"], "SUCCEEDED")  # soft: it runs
    (status,) = team.get("/budgets")
    assert status["state"] == "exhausted" and status["runs_out_at"] is None

    third = team.post("/jobs", {"name": "third", "command": "true"})
    assert third["warnings"][0].startswith("budget exhausted: tenant budget-team used ")
    held = wait_for(lambda: (j := team.get(f"/jobs/{third['id']}"))["reason"] and j)
    assert held["state"] == "PENDING"
    assert held["reason"].startswith("budget exhausted: tenant budget-team used ")
    assert held["reason"].endswith("GPU-hours in " + time.strftime("%Y-%m", time.gmtime()))

    spec = tmp_path / "job.yaml"
    spec.write_text("name: fourth\ncommand: 'true'\n")
    env = {**server.env, "GPUCLOUD_API_KEY": key}
    cli = subprocess.run(
        [GPUCLOUD, "job", "submit", str(spec), "--no-upload", "--json"],
        env=env, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert cli.stderr.startswith("warning: budget exhausted: tenant budget-team")

    admin.put("/tenants/budget-team/budgets", {**budget, "amount": 1000})
    assert wait_state(team, third["id"], "SUCCEEDED")["reason"] != held["reason"]
    actions = [e["action"] for e in admin.get("/audit") if e["target"] == "budget/budget-team"]
    # each crossing once this month, though every pass while it held "third" saw it spent
    assert actions == ["budget.set", "budget.exhausted", "budget.soft_crossed", "budget.set"]


def test_a_budget_forecasts_its_end_and_may_stop_running_jobs(server):
    admin, team = server.client(), server.tenant("stop-team")
    job = team.post("/jobs", {"name": "long", "command": "sleep 120", "gpus": 2})
    wait_state(team, job["id"], "RUNNING")
    asked = time.time()
    status = admin.put("/tenants/stop-team/budgets", {"unit": "gpu_hours", "amount": 0.05})
    answered = time.time()
    assert status["burn_per_hour"] == 2 and status["state"] == "ok"
    left = (0.05 - status["spent"]) / 2 * 3600  # seconds at 2 GPUs
    assert asked + left - 1 <= status["runs_out_at"] <= answered + left + 1

    admin.put(
        "/tenants/stop-team/budgets",
        {"unit": "usd", "amount": 1e-9, "on_exhausted": "stop"},
    )
    stopped = wait_state(team, job["id"], "CANCELLED")
    assert stopped["reason"].startswith("budget exhausted: tenant stop-team used ")
    assert stopped["reason"].endswith("; stopped (on_exhausted: stop)")
    stops = [e for e in admin.get("/audit") if e["action"] == "budget.stop"]
    assert stops[0]["target"] == f"job/{job['id']}"


def test_a_label_budget_covers_deployments_and_holds_their_restarts(server):
    admin, team = server.client(), server.tenant("serve-team")
    dep = team.post("/deployments", {"name": "chat", "labels": {"team": "serve"},
                                      **fake_replica.spec()})  # fmt: skip
    assert dep["labels"] == {"team": "serve"}
    ready = wait_for(lambda: (d := team.get("/deployments/chat"))["ready_replicas"] and d)
    (rows,) = [team.get("/usage/showback", by="kind,label:team")["rows"]]
    assert [r["group"] for r in rows] == [{"kind": "deployment", "label:team": "serve"}]
    status = admin.put("/tenants/serve-team/budgets",
                       {"label": "team=serve", "unit": "gpu_hours", "amount": 1e-9})  # fmt: skip
    assert status["state"] == "exhausted" and status["spent"] > 0  # its replica's hours count

    (replica,) = ready["replica_list"]
    for pid in workload_pids(server.home, f"replica-{replica['id']}"):
        with contextlib.suppress(ProcessLookupError):  # gone with its parent already
            os.kill(pid, signal.SIGKILL)
    held = wait_for(
        lambda: "budget" in ((r := team.get("/deployments/chat")["replica_list"][0])["reason"]
                             or "") and r
    )  # fmt: skip
    assert held["state"] == "PENDING" and held["restarts"] == 1
    assert held["reason"].startswith("budget exhausted: tenant serve-team label team=serve used")
    admin.put("/tenants/serve-team/budgets",
              {"label": "team=serve", "unit": "gpu_hours", "amount": 1e6})  # fmt: skip
    back = wait_for(lambda: (r := team.get("/deployments/chat")["replica_list"][0])["state"]
                    in ("STARTING", "READY") and r)  # fmt: skip
    assert back["reason"] is None  # what held it is over; a failure would still show
    team.delete("/deployments/chat")
