"""Spec files with a mistake: one line that names the place and what is allowed."""

from __future__ import annotations

import pytest

from gpucloud.control import specfile
from gpucloud.control.schemas import DeploymentSpec, JobSpec
from gpucloud.errors import ConfigError

JOB_CASES = [
    ("command: true", "command: expected a string or a list of strings, got true"),
    ("command: [echo, 1]", "command[1]: expected a string, got 1"),
    ("command: {a: 1}", "command: expected a string or a list of strings, got a mapping"),
    ("command: x\ngpus: two", 'gpus: expected a number, got "two"'),
    ("command: x\npriority: urgent", 'expected one of low, normal, high, got "urgent"'),
    ("command: x\npreemptible: maybe", 'preemptible: expected true or false, got "maybe"'),
    ("command: x\nenv: [A]", "env: expected a mapping of strings to strings, got a list"),
    ("command: x\nenv: {A: 1}", "env.A: expected a string, got 1"),
    ("command: x\ngpus: 0", "gpus: 0 GPUs: give a whole number of GPUs, or a share of one"),
    ("command: x\ngpus: 0.33", "gpus: 0.33 GPUs: give a whole number of GPUs, or a share"),
    ("command: x\ngpus: -1.7e308", "gpus: -1.7e+308 GPUs: give a whole number of GPUs"),
    ("comand: x", "comand: unknown key; did you mean 'command'?"),
    ("train: a.toml\ncommand: x", "give exactly one of 'command' or 'train'"),
]


@pytest.mark.parametrize(("body", "message"), JOB_CASES)
def test_a_bad_job_spec_says_which_key_and_what_it_accepts(tmp_path, body, message):
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: x\n{body}\n")
    with pytest.raises(ConfigError) as e:
        specfile.load(spec, JobSpec)
    assert str(e.value).startswith(f"{spec}: ") and message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("engine_args: --x", 'engine_args: expected a list of strings, got "--x"'),
        ("autoscale: {max_replicas: a}", 'autoscale.max_replicas: expected an integer, got "a"'),
        ("autoscale: {max_replicas: 2, top: 1}", "autoscale.top: unknown key; allowed: min_"),
        ("autoscale: 3", "autoscale: expected a mapping with keys min_replicas, max_replicas"),
    ],
)
def test_a_bad_deployment_spec_says_which_key_and_what_it_accepts(tmp_path, body, message):
    spec = tmp_path / "web.yaml"
    spec.write_text(f"name: web\nmodel_dir: /m\n{body}\n")
    with pytest.raises(ConfigError) as e:
        specfile.load(spec, DeploymentSpec)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("job.yaml", "name: x\ncommand: [a\n", ":3:1: expected ',' or ']', but got '<stream end>'"),
        ("job.yaml", "name: x\n\tcommand: a\n", ":2:1: found character '\\t' that cannot start"),
        ("job.yaml", "name: x\ncommand: a: b\n", ":2:11: mapping values are not allowed here"),
        ("job.toml", "name = 'x'\ncommand =\n", ":2:10: Invalid value"),
    ],
)
def test_a_syntax_error_gives_file_line_and_column(tmp_path, name, text, message):
    spec = tmp_path / name
    spec.write_text(text)
    with pytest.raises(ConfigError) as e:
        specfile.load(spec, JobSpec)
    assert str(e.value).startswith(f"{spec}{message}") and "\n" not in str(e.value)
