"""The model registry on a real control plane: versions numbered per name by content, seen
only by their tenant (and operators), lineage from a run dir, deployments and rollouts
naming NAME:VERSION, eval results stored per version, and the canary's eval gate.

The eval result is scored once, for real (`gpucloud eval NAME:VERSION` on the tiny model);
the gate's other cases post copies of it, one made worse item by item."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gpucloud.control.errors import ConflictError, ForbiddenError
from gpucloud.errors import NotFoundError, UserError
from gpucloud.models.content import model_content

from .conftest import GPUCLOUD

FACTS = Path(__file__).resolve().parents[2] / "examples" / "eval" / "facts.jsonl"


def _cli(server, *args: str, key: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**server.env, "GPUCLOUD_API_KEY": key}
    return subprocess.run([GPUCLOUD, *args], env=env, capture_output=True, text=True,
                          check=check, timeout=300)  # fmt: skip


def _register(client, name: str, model_dir: Path, **lineage) -> dict:
    content = model_content(model_dir)
    body = {"uri": str(model_dir), "content_hash": content.hash, "hash_kind": content.kind,
            "files": content.files, **lineage}  # fmt: skip
    return client.post(f"/models/{name}/versions", body)


def _variant(model_dir: Path, where: Path, max_new_tokens: int = 16) -> Path:
    """A copy of the model with one file more: other content, the same weights."""
    shutil.copytree(model_dir, where)
    (where / "generation_config.json").write_text(f'{{"max_new_tokens": {max_new_tokens}}}\n')
    return where


def _worse(result: dict) -> dict:
    """The result with every item answered wrong."""
    worse = copy.deepcopy(result)
    for item in worse["items"]:
        item["acc"] = item["acc_norm"] = 0.0
    worse["score"] = 0.0
    return worse


@pytest.fixture(scope="module")
def scored(sqlite_server, tiny_model_dir) -> dict:
    """`gpucloud eval base:1 --task facts.jsonl`: scored in process from the registered dir
    and stored on the version; the result as --json printed it."""
    key = sqlite_server.client().post("/tenants", {"name": "reg-scored"})["api_key"]
    team = sqlite_server.client(key)
    _register(team, "base", tiny_model_dir)
    out = _cli(sqlite_server, "eval", "base:1", "--task", str(FACTS), "--kv-cache-mb", "4",
               "--json", key=key).stdout  # fmt: skip
    result = json.loads(out)
    (stored,) = team.get("/models/base/versions/1")["evals"]
    assert result["model"] == "base:1" and result["n"] == 30
    assert (stored["task"], stored["task_hash"], stored["score"]) == (
        "facts", result["task_hash"], result["score"])  # fmt: skip
    return result


def test_versions_by_content_lineage_and_tenancy(shared_server, tiny_model_dir, tmp_path):
    team = shared_server.tenant("reg-team")
    first = _register(team, "tiny", tiny_model_dir)
    assert (first["ref"], first["created"], first["hash_kind"]) == ("tiny:1", True, "sha256")
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= first["files"].keys()
    again = _register(team, "tiny", tiny_model_dir)  # the same content: that version back
    assert (again["ref"], again["created"]) == ("tiny:1", False)
    # what training started from names the base: its registered version is found by its path
    ft = _register(team, "tiny-ft", _variant(tiny_model_dir, tmp_path / "ft"),
                   base_model=str(tiny_model_dir), step=40, run="/runs/ft")  # fmt: skip
    assert (ft["ref"], ft["base"], ft["step"]) == ("tiny-ft:1", "tiny:1", 40)
    ft2 = _register(team, "tiny-ft", _variant(tiny_model_dir, tmp_path / "ft2", 32),
                    base="tiny-ft:1")  # fmt: skip
    assert (ft2["ref"], ft2["base"]) == ("tiny-ft:2", "tiny-ft:1")
    assert team.get("/models/tiny-ft/versions/latest")["version"] == 2
    history = team.get("/models/tiny-ft/history")
    assert [v["ref"] for v in history["versions"]] == ["tiny-ft:1", "tiny-ft:2"]
    assert [b["ref"] for b in history["bases"]] == ["tiny:1"]
    with pytest.raises(
        NotFoundError, match="model 'tiny-ft' has no version 9: its versions are 1 to 2"
    ):
        team.get("/models/tiny-ft/versions/9")
    with pytest.raises(NotFoundError, match="unknown model 'tiny-fx': did you mean tiny-ft"):
        team.get("/models/tiny-fx/history")
    with pytest.raises(NotFoundError, match="unknown model 'nope': choose one of tiny, tiny-ft"):
        _register(team, "x", tiny_model_dir, base="nope:1")

    # A deployment names a version (or NAME: the latest) and serves its directory.
    dep = team.post("/deployments", {"name": "reg-dep", "model": "tiny-ft", "replicas": 0})
    assert (dep["model"], dep["model_dir"]) == ("tiny-ft:2", str(tmp_path / "ft2"))
    rolled = team.post("/deployments/reg-dep/rollout", {"model": "tiny:1", "guard": None})
    assert (rolled["canary"]["model_ref"], rolled["canary"]["model_dir"]) == (
        "tiny:1", str(tiny_model_dir))  # fmt: skip
    with pytest.raises(UserError, match="give exactly one of model_dir"):
        team.post("/deployments", {"name": "both", "model": "tiny:1", "model_dir": "/m"})
    with pytest.raises(UserError, match="model: String should match pattern"):
        team.post("/deployments", {"name": "bad", "model": "tiny:v1"})

    # Another tenant sees none of it; an operator sees every tenant's.
    other = shared_server.tenant("reg-other")
    assert other.get("/models") == []
    with pytest.raises(NotFoundError, match="none is registered yet"):
        other.post("/deployments", {"name": "steal", "model": "tiny:1", "replicas": 0})
    with pytest.raises(ForbiddenError, match="only the operator tenant"):
        other.get("/models/tiny/history", tenant="reg-team")
    ops = shared_server.client()
    listed = {(m["tenant"], m["name"]): m for m in ops.get("/models")}
    assert listed["reg-team", "tiny-ft"]["latest"] == 2
    seen = ops.get("/models/tiny-ft/history", tenant="reg-team")
    assert [v["ref"] for v in seen["versions"]] == ["tiny-ft:1", "tiny-ft:2"]


def test_concurrent_registers_of_one_name_each_get_a_version(shared_server):
    """Registers of one name at the same moment: each content its own version, the same
    content the same one, never a 500 (on PostgreSQL two could read the same highest number
    and meet the unique constraint)."""
    key = shared_server.client().post("/tenants", {"name": "reg-race"})["api_key"]
    hashes = [f"sha256:{i:064x}" for i in range(8)] * 2  # each content twice
    start = threading.Barrier(len(hashes))

    def register(content_hash: str) -> httpx.Response:
        body = {"uri": "/m", "content_hash": content_hash, "hash_kind": "given"}
        auth = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=shared_server.url + "/api/v1", headers=auth) as http:
            start.wait()
            return http.post("/models/race/versions", json=body)

    with ThreadPoolExecutor(len(hashes)) as pool:
        answers = list(pool.map(register, hashes))
    assert sorted(r.status_code for r in answers) == [200] * 8 + [201] * 8, [
        r.text for r in answers if r.status_code >= 300]  # fmt: skip
    version_of = {}
    for content_hash, r in zip(hashes, answers, strict=True):
        assert version_of.setdefault(content_hash, r.json()["version"]) == r.json()["version"]
    assert sorted(version_of.values()) == list(range(1, 9))


def test_a_train_job_starts_from_a_registered_model(shared_server, tiny_model_dir, tmp_path):
    """The job keeps the version it named; its run gets the version's dir as model.path."""
    from gpucloud.control.models import Job
    from gpucloud.control.workloads import train_command

    team = shared_server.tenant("reg-jobs")
    _register(team, "base", tiny_model_dir)
    spec = {"name": "ft", "train": str(tmp_path / "absent.toml"), "model": "base"}
    job = team.post("/jobs", spec)
    team.post(f"/jobs/{job['id']}/cancel")  # the config is absent: it could only fail
    assert (job["model"], job["train"]) == ("base:1", spec["train"])
    with pytest.raises(NotFoundError, match="unknown model 'bse': did you mean base"):
        team.post("/jobs", {**spec, "model": "bse:1"})
    with pytest.raises(UserError, match="'model' is the model a 'train' job starts from"):
        team.post("/jobs", {"name": "x", "command": "true", "model": "base:1"})
    row = Job(id=9, attempts=0, train_config=spec["train"], model_dir=str(tiny_model_dir))
    command = train_command(row, tmp_path / "run", 1, 1)
    assert command.endswith(f"--set 'model.path=\"{tiny_model_dir}\"'")


def test_promotion_requires_a_stored_eval_not_worse_than_stable(
    shared_server, tiny_model_dir, tmp_path, scored
):
    team = shared_server.tenant("reg-gate")
    _register(team, "m", tiny_model_dir)
    _register(team, "m", _variant(tiny_model_dir, tmp_path / "m2"))
    gate = {"task": "facts", "task_hash": scored["task_hash"]}
    team.post("/deployments", {"name": "raw", "model_dir": str(tiny_model_dir), "replicas": 0})
    with pytest.raises(ConflictError, match="not a registered model: a required eval has no"):
        team.post("/deployments/raw/rollout", {"model": "m:2", "require_eval": gate})
    with pytest.raises(UserError, match="require_eval compares registered models"):
        team.post("/deployments/raw/rollout", {"model_dir": "/m", "require_eval": gate})

    team.post("/deployments", {"name": "gated", "model": "m:1", "replicas": 0})
    rolled = team.post("/deployments/gated/rollout",
                       {"model": "m:2", "require_eval": gate, "guard": None})  # fmt: skip
    assert rolled["canary"]["require_eval"] == gate
    for missing in ("m:1", "m:2"):
        with pytest.raises(ConflictError, match=f"{missing} .* has no stored result on task facts"):
            team.post("/deployments/gated/promote")
        team.post(f"/models/m/versions/{missing[-1]}/evals", _worse(scored))
    team.post("/models/m/versions/1/evals", scored)  # the same file again: replaced
    with pytest.raises(ConflictError, match="canary m:2 is worse than stable m:1 on task facts"):
        team.post("/deployments/gated/promote")
    # evaluated again on the same file: the new result replaces the old, and passes
    team.post("/models/m/versions/2/evals", scored)
    assert len(team.get("/models/m/versions/2")["evals"]) == 1
    promoted = team.post("/deployments/gated/promote")
    assert (promoted["version"], promoted["model"], promoted["canary"]) == (2, "m:2", None)
    (event,) = [e for e in team.get("/audit") if e["action"] == "deployment.promote"]
    assert event["detail"]["eval"]["worse"] is False and event["detail"]["eval"]["difference"] == 0


def test_bad_eval_results_are_refused(shared_server, tiny_model_dir, scored):
    team = shared_server.tenant("reg-bad-eval")
    _register(team, "m", tiny_model_dir)
    with pytest.raises(UserError, match="a multiple_choice task has no metric 'exact_match'"):
        team.post("/models/m/versions/1/evals", {**scored, "metric": "exact_match"})
    with pytest.raises(UserError, match="the result has 30 items but n = 3"):
        team.post("/models/m/versions/1/evals", {**scored, "n": 3})
    with pytest.raises(UserError, match="items"):
        team.post("/models/m/versions/1/evals", {k: v for k, v in scored.items() if k != "items"})
    broken = {**scored, "items": [*scored["items"][:-1], {"acc": 1.0}]}
    with pytest.raises(UserError, match="item 29 of the result has no number for acc_norm"):
        team.post("/models/m/versions/1/evals", broken)


def test_a_perplexity_result_is_stored_with_its_windows(sqlite_server, tiny_model_dir, tmp_path):
    """`gpucloud eval NAME:VERSION --stride N` on a perplexity task: the stored result says
    which windows it scored (results of other strides differ)."""
    key = sqlite_server.client().post("/tenants", {"name": "reg-windows"})["api_key"]
    team = sqlite_server.client(key)
    _register(team, "m", tiny_model_dir)
    task = tmp_path / "ppl.jsonl"
    task.write_text('{"text": "A short document."}\n{"text": "def f():\\n    return 1"}\n')
    out = _cli(sqlite_server, "eval", "m:1", "--task", str(task), "--stride", "100",
               "--kv-cache-mb", "4", "--json", key=key).stdout  # fmt: skip
    result = json.loads(out)
    stored = team.get(f"/models/m/versions/1/evals/{result['task_hash']}")
    assert (stored["max_length"], stored["stride"]) == (2047, 100) == (
        result["max_length"], result["stride"])  # fmt: skip


def test_cli_registers_a_run_shows_its_lineage_and_refuses_a_worse_canary(
    sqlite_server, tiny_model_dir, tmp_path, scored
):
    """`model register --run` reads the run dir's config and newest checkpoint; `model
    history` shows base -> versions with their evals; `deploy promote` of a worse canary
    is a one-line error, exit 2."""
    from gpucloud.train import config

    key = sqlite_server.client().post("/tenants", {"name": "reg-cli"})["api_key"]
    team = sqlite_server.client(key)
    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    run = tmp_path / "run"
    cfg = config.parse({"model": {"path": str(tiny_model_dir)}, "data": {"path": str(data)},
                        "optim": {"max_steps": 8, "global_batch": 2},
                        "recipe": {"kind": "sft"}})  # fmt: skip
    for step in (4, 8):  # committed checkpoints; a step-12 left half-written by a crash
        (run / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
        (run / "checkpoints" / f"step-{step:08d}" / ".metadata").write_bytes(b"")
        (run / "checkpoints" / f"step-{step:08d}" / "train.json").write_text(f'{{"step": {step}}}')
    (run / "checkpoints" / "step-00000012").mkdir()
    config.save(cfg, run / "config.json")
    _register(team, "base", tiny_model_dir)
    ft = _variant(tiny_model_dir, tmp_path / "ft")
    out = _cli(sqlite_server, "model", "register", "ft", str(ft), "--run", str(run),
               "--json", key=key).stdout  # fmt: skip
    v = json.loads(out)
    assert (v["ref"], v["base"], v["step"], v["run"]) == ("ft:1", "base:1", 8, str(run))
    assert v["dataset"] == str(data) and v["dataset_hash"].startswith("sha256:")
    assert v["train_config"]["recipe"]["kind"] == "sft"

    team.post("/models/base/versions/1/evals", scored)
    team.post("/models/ft/versions/1/evals", _worse(scored))
    # eval compare reads the results stored on NAME:VERSION (on the one task both have)
    worse = _cli(sqlite_server, "eval", "compare", "base:1", "ft:1", "--json", key=key,
                 check=False)  # fmt: skip
    assert worse.returncode == 1 and json.loads(worse.stdout)["task"] == "facts"
    (tmp_path / "base.json").write_text(json.dumps(scored))
    _cli(sqlite_server, "eval", "compare", "ft", str(tmp_path / "base.json"), key=key)
    bad = _cli(sqlite_server, "eval", "compare", "base:1", "ft:7", "--task", str(FACTS), key=key,
               check=False)  # fmt: skip
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "model 'ft' has no version 7: its versions are 1 to 1" in bad.stderr
    with pytest.raises(NotFoundError, match="unknown model 'nope': choose one of base, ft"):
        team.get(f"/models/nope/versions/1/evals/{scored['task_hash']}")
    with pytest.raises(NotFoundError, match=r"ft:1 has no stored result on task file sha256:0"):
        team.get(f"/models/ft/versions/1/evals/sha256:{'0' * 64}")
    history = _cli(sqlite_server, "model", "history", "ft", key=key).stdout
    assert "base:1" in history and "ft:1" in history and "facts" in history
    listed = _cli(sqlite_server, "model", "list", "--registered", "--json", key=key).stdout
    assert [m["name"] for m in json.loads(listed)] == ["base", "ft"]

    team.post("/deployments", {"name": "chat", "model": "base:1", "replicas": 0})
    _cli(sqlite_server, "deploy", "rollout", "chat", "--model", "ft:1", "--require-eval",
         str(FACTS), "--no-auto-rollback", key=key)  # fmt: skip
    refused = _cli(sqlite_server, "deploy", "promote", "chat", key=key, check=False)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "canary ft:1 is worse than stable base:1 on task facts" in refused.stderr
    assert team.get("/deployments/chat")["canary"]["model_ref"] == "ft:1"
