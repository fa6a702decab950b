"""`gpucloud serve` refuses bad input with one line and exit code 2, before listening."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

CLI = [sys.executable, "-c", "from gpucloud.cli.main import app; app()", "serve"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def test_a_missing_model_dir_is_one_line_and_exit_2(tmp_path):
    r = run(str(tmp_path / "nothing"), "--port", "1")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0
    assert "cannot read model config" in r.stderr


def test_bad_options_are_exit_2(tiny_model_dir):
    r = run(str(tiny_model_dir), "--log-level", "loud")
    assert r.returncode == 2 and "debug, info, warning, error" in r.stderr
    r = run(str(tiny_model_dir), "--max-num-seqs", "0", "--kv-cache-bytes", "1000000")
    assert r.returncode == 2 and "max_num_seqs must be a positive integer" in r.stderr


def test_bad_speculative_options_are_exit_2(tiny_model_dir):
    r = run(str(tiny_model_dir), "--speculative", "eagle", "--kv-cache-bytes", "1000000")
    assert r.returncode == 2 and "speculative 'eagle' is not supported: use ngram" in r.stderr
    r = run(str(tiny_model_dir), "--speculative", "ngram", "--num-speculative-tokens", "0")
    assert r.returncode == 2 and "num_speculative_tokens must be a positive" in r.stderr


def test_an_unsupported_quantization_is_one_line_and_exit_2(tiny_model_dir, tmp_path):
    r = run(str(tiny_model_dir), "--quantization", "int3", "--port", "1")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "quantization 'int3' is not supported: use int8 or int4" in r.stderr
    bnb = tmp_path / "bnb"
    shutil.copytree(tiny_model_dir, bnb)
    config = json.loads((bnb / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (bnb / "config.json").write_text(json.dumps(config))
    r = run(str(bnb), "--port", "1")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "quant_method 'bitsandbytes' is not supported: gptq or awq" in r.stderr
