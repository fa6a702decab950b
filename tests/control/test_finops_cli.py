"""`gpucloud price`, `gpucloud budget` and `gpucloud usage --by` against the session's
SQLite server (the CLI only talks HTTP). The price set here is for a pool no node of that
server is in, so the other tests keep the catalog's prices."""

from __future__ import annotations

import json
import subprocess

from .conftest import GPUCLOUD


def _cli(server, *args: str, key: str | None = None) -> subprocess.CompletedProcess:
    env = {**server.env, "GPUCLOUD_API_KEY": key or server.admin_key}
    return subprocess.run([GPUCLOUD, *args], env=env, capture_output=True, text=True, timeout=60)


def test_price_budget_and_showback_commands(sqlite_server):
    s = sqlite_server
    key = json.loads(_cli(s, "tenant", "create", "cli-budget", "--json").stdout)["api_key"]
    price = json.loads(_cli(s, "price", "set", "L4", "0.5", "--pool", "tier=none", "--json").stdout)
    assert (price["pool"], price["per_hour"]) == ("tier=none", 0.5)
    past = _cli(s, "price", "set", "L4", "1", "--from", "2020-01-01")
    assert past.returncode == 2 and "is in the past" in past.stderr

    budget = _cli(s, "budget", "set", "cli-budget", "10", "--unit", "usd", "--json")
    assert json.loads(budget.stdout)["state"] == "ok"
    bad = _cli(s, "budget", "set", "cli-budget", "10", "--unit", "eur")
    assert bad.returncode == 2 and "unit: Input should be 'gpu_hours' or 'usd'" in bad.stderr
    (mine,) = json.loads(_cli(s, "budget", "list", "--json", key=key).stdout)
    assert (mine["tenant"], mine["amount"], mine["unit"]) == ("cli-budget", 10, "usd")
    assert _cli(s, "budget", "delete", "cli-budget").stdout == "budget of cli-budget removed\n"
    assert json.loads(_cli(s, "budget", "list", "--json", key=key).stdout) == []

    assert "Usage by tenant, label" in _cli(s, "usage", "--by", "tenant,label", key=key).stdout
    dim = _cli(s, "usage", "--by", "project", key=key)
    assert dim.returncode == 2 and "'project' is not a dimension" in dim.stderr
