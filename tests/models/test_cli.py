"""`gpucloud model` through the installed entry point: what a user runs and sees."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpucloud.cli.main import _app
from gpucloud.models import PRESETS

GPUCLOUD = str(Path(sys.executable).with_name("gpucloud"))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([GPUCLOUD, *args], capture_output=True, text=True, timeout=120)


def test_init_then_info_of_the_dir(tmp_path: Path):
    out = tmp_path / "m"
    done = CliRunner().invoke(_app, ["model", "init", "--preset", "tiny", "--out", str(out),
                                     "--seed", "7", "--dtype", "bfloat16", "--json"])  # fmt: skip
    assert done.exit_code == 0, done.output
    made = json.loads(done.stdout)
    assert made["params"] == PRESETS["tiny"].num_params and made["dtype"] == "bfloat16"
    assert made["weight_file_bytes"] > made["weights_bytes"] == 2 * made["params"]
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json", "generation_config.json"}  # fmt: skip
    info = CliRunner().invoke(_app, ["model", "info", str(out)])
    assert info.exit_code == 0
    assert "223,552" in info.stdout and "tokenizer vocab" in info.stdout
    assert "bfloat16" in info.stdout


def test_info_notes_a_tokenizer_smaller_than_the_vocab(tiny_dir: Path, tmp_path: Path):
    config = json.loads((tiny_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"vocab_size": 4096}))
    (tmp_path / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    result = CliRunner().invoke(_app, ["model", "info", str(tmp_path), "--json"])
    info = json.loads(result.stdout)
    assert info["tokenizer_vocab_size"] == 2048 and info["vocab_size"] == 4096
    assert "uses 2048 of the 4096 embedding rows" in info["note"]
    assert info["weight_files"] == [] and info["dtype"] == "float32"


def test_list_names_every_preset():
    result = CliRunner().invoke(_app, ["model", "list", "--json"])
    rows = json.loads(result.stdout)
    assert [r["name"] for r in rows] == list(PRESETS)
    table = CliRunner().invoke(_app, ["model", "list"]).stdout
    assert all(name in table for name in PRESETS) and "46.70B" in table


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["info", "llama-3-8bb"], "unknown model 'llama-3-8bb': did you mean llama-3-8b"),
        (["init", "--preset", "smal", "--out", "{tmp}/x"], "did you mean small"),
        (["init", "--out", "{tmp}/full"], "is not empty: choose a new directory or pass --force"),
        (["info", "{tmp}/full"], "cannot read model config"),
        (["info", "tiny", "--dtype", "fp8"], "unknown dtype 'fp8': use one of float32, bfloat16"),
        (["init", "--preset", "mixtral-8x7b", "--out", "{tmp}/y"], "random init is for tests"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    done = _run("model", *(a.format(tmp=tmp_path) for a in args))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
