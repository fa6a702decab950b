"""Schemathesis fuzzes every operation of the OpenAPI schema: no input answers 500."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCHEMATHESIS = str(Path(sys.executable).parent / "schemathesis")


def test_no_input_makes_the_api_answer_500(shared_server, tmp_path):
    # A tenant admin's key: the fuzzer may create users, submit jobs and deployments, but
    # cannot cordon the node or create tenants (those paths are still fuzzed, as 403s).
    key = shared_server.client().post("/tenants", {"name": "fuzz"})["api_key"]
    r = subprocess.run(
        [
            SCHEMATHESIS,
            "run",
            f"{shared_server.url}/openapi.json",
            "--checks",
            "not_a_server_error",
            "--max-examples",
            "10",
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
