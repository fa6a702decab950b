"""The CLI against a real server: login, tenants, quotas, nodes, jobs, deployments, usage,
and one-line errors with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import GPUCLOUD, wait_for


@pytest.fixture
def shared_server(sqlite_server):
    """The CLI only talks HTTP: the SQLite server is enough (the API suite runs on both)."""
    return sqlite_server


def _cli(server, *args: str, key: str | None = None, check: bool = True, cwd=None):
    env = {**server.env, "GPUCLOUD_API_KEY": key or server.admin_key}
    return subprocess.run(
        [GPUCLOUD, *args], env=env, capture_output=True, text=True, check=check, timeout=60,
        cwd=cwd,
    )  # fmt: skip


def _json(server, *args: str, key: str | None = None, cwd=None):
    return json.loads(_cli(server, *args, "--json", key=key, cwd=cwd).stdout)


def test_cli_end_to_end(shared_server, tmp_path, monkeypatch):
    s = shared_server
    created = _json(s, "tenant", "create", "cli-team")
    key = created["api_key"]
    assert created["name"] == "cli-team" and key.startswith("gpc_")
    quota = _json(s, "quota", "set", "cli-team", "l4", "3")
    assert quota["quotas"] == [{"gpu_type": "L4", "gpus": 3}]
    (node,) = _json(s, "node", "list")
    assert node["gpus"] == 4 and node["state"] == "ready"
    assert f"0 / {node['cpus']:g}" in _cli(s, "node", "list").stdout  # cpus: allocated / all

    # The directory it is submitted from is uploaded (without .git, or what .gpucloudignore
    # lists) and the job runs in that copy, in the tenant's area.
    project = tmp_path / "project"
    (project / ".git").mkdir(parents=True)
    (project / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (project / "input.txt").write_text("hello world\n")
    (project / "weights.bin").write_bytes(b"\0" * 64)
    (project / ".gpucloudignore").write_text("*.bin\n")
    shared = tmp_path / "shared"  # a linked dir is sent as what it holds; a loop ends
    shared.mkdir()
    (shared / "lib.txt").write_text("linked\n")
    (shared / "back").symlink_to(tmp_path)
    (project / "lib").symlink_to(shared)
    (project / "job.yaml").write_text(
        "name: hi\ncommand: [sh, -c, cat input.txt lib/lib.txt; ls -A]\ngpus: 1\ncpus: 0.5\n"
        "checkpoint_dir: runs/hi\n"
    )
    submitted = _cli(s, "job", "submit", "job.yaml", "--json", key=key, cwd=project)
    assert submitted.stderr.startswith(f"uploaded {project} (4 files,")
    job = json.loads(submitted.stdout)
    assert (
        job["state"] == "PENDING" and job["command"] == "sh -c 'cat input.txt lib/lib.txt; ls -A'"
    )
    assert (job["cpus"], job["memory_gib"]) == (0.5, 0)
    area = s.home / "tenants" / "cli-team"
    assert job["workdir"].startswith(f"{area}/uploads/")
    assert job["checkpoint_dir"] == job["workdir"] + "/runs/hi"
    logs = _cli(s, "job", "logs", "-f", str(job["id"]), key=key).stdout
    assert logs == "hello world\nlinked\n.gpucloudignore\ninput.txt\njob.yaml\nlib\nruns\n"
    (listed,) = _json(s, "job", "list", key=key)
    assert {k: listed[k] for k in ("id", "name", "state", "attempts")} == {
        "id": job["id"],
        "name": "hi",
        "state": "SUCCEEDED",
        "attempts": 1,
    }
    table = _cli(s, "job", "get", str(job["id"]), key=key).stdout
    assert "SUCCEEDED" in table and "exit code 0" in table

    dep = _json(s, "deploy", "create", "web", "/models/x", "--replicas", "0",
                "--memory-gib", "1.5", key=key)  # fmt: skip
    assert dep["name"] == "web" and dep["memory_gib"] == 1.5
    assert [d["name"] for d in _json(s, "deploy", "list", key=key)] == ["web"]
    rolled = _json(s, "deploy", "rollout", "web", "--model", "/models/y", "--canary", "20",
                   "--max-ttft-ratio", "3", key=key)["canary"]  # fmt: skip
    assert (rolled["number"], rolled["model_dir"], rolled["percent"]) == (2, "/models/y", 20)
    assert rolled["guard"]["max_ttft_ratio"] == 3 and rolled["guard"]["window"] == 60
    assert rolled["guard"]["max_restarts"] == 3
    _cli(s, "deploy", "delete", "web", key=key)
    # A model dir the tenant's user could not read where it is (tmp_path is root's, 0700).
    private = tmp_path / "model"
    private.mkdir()
    (private / "config.json").write_text("{}\n")
    sent = _cli(s, "deploy", "create", "uploaded", str(private), "--upload", "--replicas", "0",
                "--json", key=key)  # fmt: skip
    assert sent.stderr.startswith(f"uploaded {private} (1 file, 3 B)")
    dep = json.loads(sent.stdout)
    assert dep["model_dir"].startswith(f"{area}/uploads/")
    assert (Path(dep["model_dir"]) / "config.json").read_text() == "{}\n"
    _cli(s, "deploy", "delete", "uploaded", key=key)
    # An s3:// model is not a local path; --env NAME passes this shell's value.
    env = {**s.env, "GPUCLOUD_API_KEY": key, "AWS_SECRET_ACCESS_KEY": "from-the-shell"}
    out = subprocess.run(
        [GPUCLOUD, "deploy", "create", "remote", "s3://models/tiny", "--replicas", "0",
         "--env", "AWS_SECRET_ACCESS_KEY", "--env", "AWS_ENDPOINT_URL=http://s3:9000", "--json"],
        env=env, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    dep = json.loads(out.stdout)
    assert dep["model_dir"] == "s3://models/tiny"
    assert "from-the-shell" not in out.stdout  # a deployment's env is not shown back
    _cli(s, "deploy", "delete", "remote", key=key)
    wait_for(lambda: _json(s, "deploy", "list", key=key) == [])

    usage = _json(s, "usage", "--since", "1h", key=key)
    assert [line["name"] for line in usage["lines"]] == ["hi"]
    assert "Usage by tenant" in _cli(s, "usage", key=key).stdout

    _cli(s, "deploy", "create", "pool", "/models/x", "--replicas", "0", key=key)
    assert _json(s, "deploy", "update", "pool", "--warm-pool", "1", key=key)["warm_pool"] == 1
    monkeypatch.setenv("COLUMNS", "250")  # the table on one line
    assert " 0/0 +0/1 warm " in _cli(s, "deploy", "list", key=key).stdout
    _cli(s, "deploy", "delete", "pool", key=key)


def test_cli_errors_are_one_line_with_exit_code_2(shared_server, tmp_path):
    s = shared_server
    specs = {
        "typo.yaml": "name: x\ncomand: true\ngpus: 1\n",
        "type.yaml": "name: x\ncommand: true\n",
        "syntax.yaml": "name: x\ncommand: [echo\n",
        "type.toml": "name = 'x'\ncommand = ['echo', 1]\n",
    }
    for name, text in specs.items():
        (tmp_path / name).write_text(text)
    for args, message in [
        (["job", "submit", str(tmp_path / "typo.yaml")], "comand: unknown key; did you mean"),
        (
            ["job", "submit", str(tmp_path / "type.yaml")],
            "command: expected a string or a list of strings, got true",
        ),
        (["job", "submit", str(tmp_path / "syntax.yaml")], "syntax.yaml:3:1: expected ','"),
        (["job", "submit", str(tmp_path / "type.toml")], "command[1]: expected a string, got 1"),
        (
            ["deploy", "create", "web", "/m", "--priority", "urgent"],
            'priority: expected one of low, normal, high, got "urgent"',
        ),
        (["job", "get", "999999"], "no job 999999"),
        (["deploy", "create", "w", "s3://b/m", "--upload"], "--upload sends a local dir"),
        (["deploy", "create", "w", "/m", "--env", "UNSET_HERE_1"], "not set in this shell"),
        (["deploy", "update", "w"], "nothing to update: give --warm-pool N"),
        (["quota", "set", "nobody", "L4", "1"], "no tenant 'nobody'"),
        (["usage", "--since", "yesterday"], "use a duration like 90m"),
    ]:
        r = _cli(s, *args, check=False)
        assert r.returncode == 2, (args, r.stderr)
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = _cli(s, "job", "list", key="gpc_wrong", check=False)
    assert r.returncode == 2 and "invalid or revoked API key" in r.stderr


def test_login_saves_credentials_readable_only_by_the_user(shared_server, tmp_path):
    env = {**shared_server.env, "GPUCLOUD_HOME": str(tmp_path)}
    env.pop("GPUCLOUD_URL")
    r = subprocess.run(
        [GPUCLOUD, "login", shared_server.url, "--api-key", shared_server.admin_key],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "as admin (admin) of tenant operator" in r.stdout
    creds = tmp_path / "credentials.json"
    assert oct(os.stat(creds).st_mode & 0o777) == "0o600"
    assert json.loads(creds.read_text())["api_key"] == shared_server.admin_key
    r = subprocess.run(
        [GPUCLOUD, "node", "list", "--json"], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0 and json.loads(r.stdout)[0]["gpus"] == 4


def test_cli_keys_create_list_rotate_revoke(shared_server):
    s = shared_server
    key = _json(s, "tenant", "create", "cli-keys")["api_key"]
    ci = _json(s, "key", "create", "ci", key=key)
    assert (ci["name"], ci["tenant"], ci["user"]) == ("ci", "cli-keys", "admin")
    out = _cli(s, "key", "create", "bot", "--tenant", "cli-keys").stdout  # as the operator
    bot = out.split("(shown once): ")[1].strip()
    assert out.startswith("key bot of tenant cli-keys created (acts as admin); ")
    assert _cli(s, "job", "list", key=bot).returncode == 0

    table = _cli(s, "key", "list", key=key).stdout
    names = [line.split()[1] for line in table.splitlines() if line.startswith("│")]
    assert names == ["admin", "bot", "ci"] and ci["prefix"] + "..." in table
    assert ci["api_key"] not in table and bot not in table
    assert [k["name"] for k in _json(s, "key", "list", key=key)] == ["admin", "bot", "ci"]

    new = _json(s, "key", "rotate", "ci", "--grace", "1h", key=key)
    old_row, new_row = [k for k in _json(s, "key", "list", key=key) if k["name"] == "ci"]
    assert new_row["prefix"] == new["prefix"] and old_row["expires_at"] - time.time() > 3500
    for k in (ci["api_key"], new["api_key"]):  # both work during the grace period
        assert _json(s, "job", "list", key=k) == []
    out = _cli(s, "key", "revoke", "ci", key=key).stdout
    assert out == f"key ci revoked: {ci['prefix']}..., {new['prefix']}...\n"
    for k in (ci["api_key"], new["api_key"]):
        r = _cli(s, "job", "list", key=k, check=False)
        assert r.returncode == 2 and "invalid or revoked API key" in r.stderr

    for args, message in [
        (["key", "rotate", "bot", "--grace", "1x"], "--grace '1x': use a duration like 30s"),
        (["key", "create", "a b"], "name: String should match pattern"),
        (["key", "create", "bot"], "already has a key named 'bot'"),
        (["key", "revoke", "ci"], "no key 'ci' in tenant cli-keys (keys: admin, bot)"),
        (["key", "list", "--tenant", "operator"], "no tenant 'operator'"),
    ]:
        r = _cli(s, *args, key=key, check=False)
        assert r.returncode == 2, (args, r.stderr)
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cli_rate_limits_priority_classes_and_cohorts(shared_server):
    s = shared_server
    key = _json(s, "tenant", "create", "cli-limits")["api_key"]
    bulk = _json(s, "key", "create", "bulk", "--priority-class", "batch",
                 "--requests-per-minute", "60", key=key)  # fmt: skip
    assert bulk["priority_class"] == "batch"
    assert bulk["rate_limit"] == {"requests_per_minute": 60, "tokens_per_minute": None}
    out = _cli(s, "key", "limit", "bulk", "--tokens-per-minute", "5000", key=key).stdout
    assert out == "key bulk: batch, 5000 tok/min\n"  # the limit is replaced whole
    assert "5000 tok/min" in _cli(s, "key", "list", key=key).stdout
    assert _cli(s, "key", "limit", "bulk", "--unlimited", key=key).stdout.endswith("unlimited\n")
    tenant = _json(s, "tenant", "rate-limit", "cli-limits", "--requests-per-minute", "600")
    assert tenant["rate_limit"] == {"requests_per_minute": 600, "tokens_per_minute": None}
    out = _cli(s, "tenant", "cohort", "cli-limits", "lab").stdout
    assert out == "tenant cli-limits: in cohort lab\n"
    listed = _cli(s, "tenant", "list").stdout
    assert "600 req/min" in listed and " lab " in listed
    assert _json(s, "tenant", "cohort", "cli-limits", "--none")["cohort"] is None
    for args, message in [
        (["key", "limit", "bulk"], "nothing to change: give --priority-class"),
        (["key", "create", "x", "--priority-class", "urgent"], "'interactive' or 'batch'"),
        (["tenant", "rate-limit", "cli-limits", "--requests-per-minute", "1"], "operator"),
        (["tenant", "cohort", "cli-limits", "lab"], "operator"),
        (["tenant", "cohort", "cli-limits"], "give a COHORT name or --none"),
    ]:
        r = _cli(s, *args, key=key, check=False)
        assert r.returncode == 2, (args, r.stderr)
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
