"""Schemathesis fuzzes every operation of the OpenAPI schema: no input answers 500. And
hypothesis fuzzes the job spec, as a dict and as a YAML file: any input parses or is refused
with a validation error, and what parses round-trips."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from json_strategies import TEXT, spoiled
from pydantic import ValidationError

from gpucloud import hardware
from gpucloud.control.schemas import JobSpec
from gpucloud.control.specfile import load
from gpucloud.errors import ConfigError

from .conftest import Server

SCHEMATHESIS = str(Path(sys.executable).parent / "schemathesis")
HOOKS = Path(__file__).with_name("schemathesis_hooks.py")


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
            "--mode",
            "all",
            "--phases",
            "examples,coverage,fuzzing",
            "--request-timeout",
            "30",
            "-H",
            f"Authorization: Bearer {key}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS)},
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


WORDS = TEXT.filter(bool)
GPU_TYPES = [a.name for a in hardware.all_accelerators()]
# Values each field accepts (and near its bounds); the spec needs one of command or train.
VALID_FIELDS = {
    "gpus": st.integers(1, 4096),
    "gpu_type": st.sampled_from(GPU_TYPES) | st.sampled_from(GPU_TYPES).map(str.lower),
    "cpus": st.floats(0, 65536) | st.integers(0, 65536),
    "memory_gib": st.floats(0, 1048576),
    "priority": st.sampled_from(["low", "normal", "high"]),
    "preemptible": st.booleans(),
    "max_retries": st.integers(0, 100),
    "env": st.dictionaries(st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_]{0,8}\Z"), TEXT, max_size=3),
    "workdir": TEXT,
    "checkpoint_dir": TEXT,
}
ENTRY_POINTS = st.one_of(
    st.fixed_dictionaries({"command": WORDS | st.lists(WORDS, min_size=1, max_size=3)}),
    st.fixed_dictionaries({"train": WORDS}),
)
valid_specs = st.builds(
    lambda name, entry, rest: {"name": name, **entry, **rest},
    st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z"),
    ENTRY_POINTS,
    st.fixed_dictionaries({}, optional=VALID_FIELDS),
)
KEYS = ["name", "command", "train", *VALID_FIELDS, "unknown_key"]


job_specs = valid_specs | valid_specs.flatmap(lambda spec: spoiled(spec, KEYS))


@settings(max_examples=300, deadline=None)
@given(job_specs)
def test_any_job_spec_parses_or_is_refused_and_what_parses_round_trips(data):
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError:
        return
    assert JobSpec.model_validate(spec.model_dump()) == spec
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec


SPEC_DIR = Path(tempfile.mkdtemp(prefix="gpucloud-specs-"))
_SURROGATE = re.compile("[\ud800-\udfff]")


def _yaml_text(data: dict) -> str:
    """`data` as YAML with raw UTF-8 text, or escaped where raw text would not read back:
    PyYAML's dumper folds some raw characters (U+0085 into a space), and a lone surrogate
    has no UTF-8 bytes."""
    text = yaml.safe_dump(data, allow_unicode=True)
    try:
        if not _SURROGATE.search(text) and yaml.safe_load(text) == data:
            return text
    except yaml.YAMLError:
        pass
    return yaml.safe_dump(data)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job_specs)
def test_a_job_file_loads_as_its_dict_validates_or_is_one_config_error(data):
    path = SPEC_DIR / "job.yaml"
    path.write_text(_yaml_text(data), encoding="utf-8")
    try:
        expected = JobSpec.model_validate(data)
    except ValidationError:
        expected = None
    try:
        spec = load(path, JobSpec)
    except ConfigError as e:
        assert expected is None and str(e).startswith(f"{path}: "), e
        return
    assert spec == expected
