"""Schemathesis fuzzes every operation of the OpenAPI schema: no input answers 500."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import Server

SCHEMATHESIS = str(Path(sys.executable).parent / "schemathesis")


@pytest.fixture(scope="module")
def fuzz_server(postgres, tmp_path_factory):
    """A server of its own on PostgreSQL (stricter than SQLite about values), with its node
    cordoned for good: the fuzzer submits jobs with random commands, and none may run."""
    home = tmp_path_factory.mktemp("fuzz")
    srv = Server(postgres.new_database(), home).start()
    node = srv.client().get("/nodes")[0]["name"]
    srv.client().post(f"/nodes/{node}/cordon")
    yield srv
    srv.stop()


def test_no_input_makes_the_api_answer_500(fuzz_server, tmp_path):
    # A tenant admin's key: the fuzzer may create users, submit jobs and deployments, but
    # cannot uncordon the node or create tenants (those paths are still fuzzed, as 403s).
    key = fuzz_server.client().post("/tenants", {"name": "fuzz"})["api_key"]
    r = subprocess.run(
        [
            SCHEMATHESIS,
            "run",
            f"{fuzz_server.url}/openapi.json",
            "--checks",
            "not_a_server_error",
            "--max-examples",
            "8",
            "--seed",
            "7",
            "--generation-deterministic",
            "--phases",
            "examples,fuzzing",
            "--request-timeout",
            "30",
            "-H",
            f"Authorization: Bearer {key}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
