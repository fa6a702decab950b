"""Checkpoints and models on object storage through the control plane: a deployment serves
an s3:// model with the credentials its own spec gives (never the control plane's), a job's
checkpoint_dir may be an s3:// URL, and other URLs are refused with what is allowed."""

from __future__ import annotations

import hashlib
import shlex
from pathlib import Path

import httpx
import openai
import pytest
from s3_helpers import s3_server

from gpucloud.control import tenancy
from gpucloud.control.config import Settings
from gpucloud.control.models import Job
from gpucloud.control.workloads import job_run_dir, train_command
from gpucloud.models.content import model_content

from .conftest import wait_for
from .test_deployments import ENGINE_ARGS, _wait_ready


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=2) as client:
        yield client


def test_a_deployment_serves_a_model_from_s3_with_its_own_credentials(
    sqlite_server, tiny_model_dir, tmp_path, http
):
    team = sqlite_server.tenant("s3-serving")
    with s3_server(tmp_path) as s3:  # the control plane was started without these AWS_*
        url = s3.upload(tiny_model_dir, s3.bucket("models") + "/tiny")
        # the registry's content of an s3:// model: its objects' ETags, nothing downloaded
        local, remote = model_content(tiny_model_dir), model_content(url)
        assert remote.kind == "etag" and remote.files.keys() == local.files.keys()
        config = (tiny_model_dir / "config.json").read_bytes()
        assert remote.files["config.json"] == "etag:" + hashlib.md5(config).hexdigest()
        creds = {k: v for k, v in s3.env.items() if k.startswith("AWS_")}
        team.post(
            "/deployments",
            {"name": "s3chat", "model_dir": url, "replicas": 1, "engine_args": ENGINE_ARGS,
             "env": creds},
        )  # fmt: skip
        dep, _ = _wait_ready(team, http, "s3chat", 1)
        client = openai.OpenAI(
            base_url=dep["replica_list"][0]["url"] + "/v1", api_key="-", max_retries=0
        )
        done = client.completions.create(model="s3chat", prompt="def", max_tokens=3)
        assert done.usage.completion_tokens == 3
        team.delete("/deployments/s3chat")
        wait_for(lambda: not any(d["name"] == "s3chat" for d in team.get("/deployments")))


def test_a_jobs_checkpoints_may_live_on_s3_and_other_urls_are_refused(sqlite_server):
    team = sqlite_server.tenant("s3-jobs")
    job = team.post(
        "/jobs",
        {"name": "ck", "command": 'echo "$GPUCLOUD_CHECKPOINT_DIR"',
         "checkpoint_dir": "s3://ckpt/run-1"},
    )  # fmt: skip
    assert job["checkpoint_dir"] == "s3://ckpt/run-1"
    wait_for(lambda: team.get(f"/jobs/{job['id']}")["state"] == "SUCCEEDED")
    assert team.get(f"/jobs/{job['id']}/logs") == "s3://ckpt/run-1\n"
    with httpx.Client(base_url=sqlite_server.url + "/api/v1", headers=team._http.headers) as h:
        r = h.post("/jobs", json={"name": "w", "command": "true", "workdir": "s3://b/w"})
        assert r.status_code == 400 and "use a path in your area" in r.text, r.text
        r = h.post("/jobs", json={"name": "g", "command": "true", "checkpoint_dir": "gs://b/c"})
        assert r.status_code == 400 and "or an s3://BUCKET/PREFIX URL" in r.text, r.text
        r = h.post("/deployments", json={"name": "g", "model_dir": "gs://b/m"})
        assert r.status_code == 422 and "use a path or an s3://BUCKET/PREFIX URL" in r.text


def test_a_training_job_keeps_its_run_dir_local_and_its_checkpoints_on_s3(tmp_path):
    settings = Settings(home=tmp_path)
    job = Job(id=7, attempts=1, train_config="/area/t.toml", checkpoint_dir="s3://ck/run")
    run_dir = job_run_dir(settings, job, "team")
    assert run_dir == tenancy.area(settings, "team") / "runs" / "job-7"
    command = shlex.split(train_command(job, run_dir, 2, 1))
    assert command[-6:] == [
        "--nproc-per-node", "2", "--run-dir", str(run_dir), "--set", "checkpoint.dir=s3://ck/run"
    ]  # fmt: skip
    local = Job(id=8, attempts=1, train_config="/area/t.toml", checkpoint_dir="/area/ck")
    assert job_run_dir(settings, local, "team") == Path("/area/ck")
    assert "--set" not in train_command(local, Path("/area/ck"), 2, 1)
