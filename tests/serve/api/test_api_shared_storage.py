"""`gpucloud serve s3://bucket/model` against a real S3-compatible server (moto): the model
is fetched once into the local cache and serves what the same directory on disk serves;
a bad URL is one line on stderr and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from api_helpers import start_server
from s3_helpers import env_without, s3_server

from gpucloud import storage, storage_cache
from gpucloud.errors import UserError
from gpucloud.serve import LLM, SamplingParams

PROMPT = "def main():"
GPUCLOUD = ["-c", "from gpucloud.cli.main import app; app()"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture(scope="module")
def model_url(s3, tiny_model_dir) -> str:
    return s3.upload(tiny_model_dir, s3.bucket("models") + "/tiny")


def test_a_model_on_s3_serves_the_same_greedy_tokens_as_from_disk(
    s3, model_url, tiny_model_dir, tmp_path
):
    server = start_server(model_url, tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]  # the URL's last part
        served = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    finally:
        server.stop()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    offline = LLM(tiny_model_dir, kv_cache_bytes=1 << 22).generate(PROMPT, params)
    assert served.choices[0].text == offline[0].outputs[0].text


def test_a_second_load_downloads_nothing_and_a_changed_upload_is_fetched_again(
    s3, model_url, tiny_model_dir
):
    first = storage.local_copy(model_url)
    files = sorted(p.relative_to(first) for p in first.rglob("*"))
    assert files == sorted(p.relative_to(tiny_model_dir) for p in tiny_model_dir.rglob("*"))
    stamps = {f: (first / f).stat().st_mtime_ns for f in files}
    again = storage.local_copy(model_url + "/")
    assert again == first
    assert {f: (again / f).stat().st_mtime_ns for f in files} == stamps  # nothing rewritten
    s3.filesystem().pipe_file(f"{model_url}/README.md", b"a new revision\n")
    changed = storage.local_copy(model_url)
    assert changed != first and changed.name == "tiny"
    assert (changed / "README.md").read_text() == "a new revision\n"
    assert (first / "config.json").read_bytes() == (changed / "config.json").read_bytes()


# A run that fetched the objects of each URL it is given, printing where, and ended.
RUN = "import sys, gpucloud.storage as s; [print(s.local_copy(u)) for u in sys.argv[1:]]"


def test_the_cache_keeps_to_its_cap_evicting_the_least_recently_used_entry_no_one_uses(
    s3, tmp_path, monkeypatch
):
    """A cap of 1.5 MiB and entries of 400 KiB: the fetch that makes them four evicts the
    least recently used one that no running process holds."""
    monkeypatch.setenv("GPUCLOUD_STORAGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(storage_cache.MAX_GB_ENV, str(1.5 / 1024))
    bucket = s3.bucket("cached")
    urls = []
    for name in "abcd":
        (tmp_path / name).mkdir()
        (tmp_path / name / "weights.bin").write_bytes(os.urandom(400 * 1024))
        urls.append(s3.upload(tmp_path / name, f"{bucket}/{name}"))
    a = storage.local_copy(urls[0])  # this process runs on with it: a replica serving a
    ended = subprocess.run([sys.executable, "-c", RUN, *urls[1:3]], capture_output=True)
    b, c = (Path(line) for line in ended.stdout.decode().split())
    assert a.is_dir() and b.is_dir() and c.is_dir()  # 1.2 MiB
    d = storage.local_copy(urls[3])
    assert not b.exists() and a.is_dir() and c.is_dir() and d.is_dir()  # a is older: in use
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        e.parent.name + lock for e in (a, c, d) for lock in ("", ".lock")
    )
    monkeypatch.setenv(storage_cache.MAX_GB_ENV, "lots")
    with pytest.raises(UserError, match=r"^GPUCLOUD_STORAGE_CACHE_MAX_GB='lots' is not a size"):
        storage.local_copy(urls[0])


@pytest.mark.parametrize(
    ("url", "env", "message"),
    [
        ("s3://no-such-bucket/tiny", {}, "not found (The specified bucket does not exist)"),
        ("s3://models/nothing-here", {}, "no such directory (no objects under this prefix)"),
        ("s3://", {}, "name a bucket and a prefix, e.g. s3://bucket/prefix"),
        (
            "s3://models/tiny",
            {"drop": "AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY"},
            "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        ),
        (
            "s3://models/tiny",
            {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_MAX_ATTEMPTS": "1"},
            "cannot reach the storage endpoint http://127.0.0.1:9 (set by AWS_ENDPOINT_URL)",
        ),
    ],
)
def test_a_bad_model_url_is_one_line_naming_it(s3, model_url, url, env, message):
    env = dict(env)
    child_env = env_without(*env.pop("drop", "").split(), **env)
    result = subprocess.run(
        [sys.executable, *GPUCLOUD, "serve", url], capture_output=True, text=True, env=child_env,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == f"error: {url}: {message}"


def test_a_missing_bucket_is_a_user_error_in_process_too(s3):
    with pytest.raises(UserError, match=r"^s3://no-such-bucket/x: not found"):
        storage.files("s3://no-such-bucket/x")
