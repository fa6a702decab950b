"""The shipped alert rules and dashboards: promtool accepts the rules and their unit tests
pass, every metric they read is one the control plane exposes (or a serve replica's), and a
real Prometheus scraping a real control plane fires the budget alert once a tenant is past
its soft threshold."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpucloud.control import alerts

from .conftest import GPUCLOUD, Server, free_port, wait_for, wait_state

HERE = Path(__file__).parent
# Series that only other processes expose: serve replicas, and the gateway once it relayed.
ELSEWHERE = {"gpucloud_serve_time_to_first_token_seconds_bucket", "gpucloud_gateway_requests_total"}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (tests/install_system_packages.sh installs it)")
    return path


@pytest.fixture
def rules_file(tmp_path) -> Path:
    """`gpucloud alerts rules`, as a user would save it, beside the rules' unit tests."""
    out = subprocess.run(
        [GPUCLOUD, "alerts", "rules"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out == alerts.rules_text()
    (tmp_path / "rules.yml").write_text(out)
    shutil.copy(HERE / "alert_rules_test.yml", tmp_path)
    return tmp_path / "rules.yml"


def test_promtool_accepts_the_rules_and_each_alert_fires_when_it_should(rules_file):
    promtool = _tool("promtool")
    check = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert check.returncode == 0 and "SUCCESS: 9 rules found" in check.stdout, check.stderr
    tested = subprocess.run(
        [promtool, "test", "rules", "alert_rules_test.yml"],
        cwd=rules_file.parent, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # every alert is exercised by the unit tests
    named = set(re.findall(r"- alert: (\w+)", rules_file.read_text()))
    tested_names = set(re.findall(r"alertname: (\w+)", (HERE / "alert_rules_test.yml").read_text()))
    assert named == tested_names and len(named) == 9


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("alerts")
    srv = Server(f"sqlite:///{home / 'state.db'}", home).start()
    yield srv
    srv.stop()


def test_rules_and_dashboards_read_only_metrics_that_exist(server):
    admin = server.client()
    admin.post("/tenants", {"name": "metered"})
    admin.put("/tenants/metered/budgets", {"unit": "usd", "amount": 10})
    text = httpx.get(server.url + "/metrics").text
    exposed = set(re.findall(r"^# TYPE (gpucloud_\w+)", text, re.MULTILINE))  # even if empty
    exposed |= set(re.findall(r"^(gpucloud_\w+?)[{ ]", text, re.MULTILINE))
    dashboards = alerts.dashboards()
    assert set(dashboards) == {"gpucloud-cluster.json", "gpucloud-cost.json"}
    panels = [p for d in dashboards.values() for p in json.loads(d)["panels"]]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    exprs += re.findall(r"expr: (.*(?:\n {10}.*)*)", alerts.rules_text())
    read = set(re.findall(r"\bgpucloud_\w+", "\n".join(exprs)))
    missing = {n for n in read - ELSEWHERE if n not in exposed | {f"{m}_bucket" for m in exposed}}
    assert missing == set() and "gpucloud_budget_runs_out_in_seconds" in read


def _prometheus(tmp_path: Path, target: str, rules: Path) -> tuple[subprocess.Popen, str]:
    """A Prometheus of its own: 127.0.0.1, a free port, scraping and evaluating each second."""
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: [{rules}]\n"
        f"scrape_configs: [{{job_name: gpucloud, static_configs: [{{targets: ['{target}']}}]}}]\n"
    )
    port = free_port()
    cmd = [_tool("prometheus"), f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}",
           f"--storage.tsdb.path={tmp_path / 'data'}"]  # fmt: skip
    log = (tmp_path / "prometheus.log").open("wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def _firing(prometheus: str) -> list[dict]:
    try:
        body = httpx.get(prometheus + "/api/v1/alerts", timeout=2).json()
    except httpx.HTTPError:
        return []
    return [a for a in body["data"]["alerts"] if a["state"] == "firing"]


def test_prometheus_fires_the_budget_alert_of_a_tenant_past_its_soft_threshold(
    server, rules_file, tmp_path
):
    admin = server.client()
    key = admin.post("/tenants", {"name": "spender"})["api_key"]
    spender = server.client(key)
    admin.post("/tenants", {"name": "frugal"})
    admin.put("/tenants/frugal/budgets", {"unit": "gpu_hours", "amount": 100})
    job = spender.post("/jobs", {"name": "burn", "command": "sleep 0.2"})
    wait_state(spender, job["id"], "SUCCEEDED")
    spent = spender.get("/usage")["tenants"]["spender"]["gpu_hours"]
    admin.put("/tenants/spender/budgets", {"unit": "gpu_hours", "amount": spent / 0.9, "soft": 0.5})

    proc, prometheus = _prometheus(tmp_path, server.url.removeprefix("http://"), rules_file)
    try:
        firing = wait_for(lambda: [a for a in _firing(prometheus)
                                   if a["labels"]["alertname"] == "GpucloudBudgetSoftThreshold"],
                          timeout=60, interval=0.5)  # fmt: skip
        assert [a["labels"]["tenant"] for a in firing] == ["spender"]  # not frugal
        assert float(firing[0]["value"]) == pytest.approx(0.9, rel=1e-3)
        assert "spender" in firing[0]["annotations"]["summary"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
