"""`gpucloud diff`: per-module numeric comparison of two configurations of one model."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from gpucloud.cli.main import _app
from gpucloud.errors import UserError
from gpucloud.hal import ops

GPUCLOUD = str(Path(sys.executable).with_name("gpucloud"))


def _diff(*args: str) -> dict:
    done = CliRunner().invoke(_app, ["diff", *args, "--json"])
    assert done.exit_code == 0, done.output
    return json.loads(done.stdout)


def _perturbed_copy(model_dir: Path, out: Path, tensor: str) -> Path:
    shutil.copytree(model_dir, out)
    weights = load_file(out / "model.safetensors")
    weights[tensor] = weights[tensor] + 0.05 * torch.randn_like(weights[tensor])
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_identical_configurations_do_not_diverge(tiny_dir: Path):
    report = _diff(str(tiny_dir), "--a", "cpu:float32", "--b", "cpu:float32", "--prompt", "hi")
    assert report["first_divergent"] is None and report["tolerance"] == 1e-3
    names = [m["name"] for m in report["modules"]]
    assert names[0] == "model.embed_tokens" and names[-1] == "lm_head"
    assert "model.layers.1.mlp" in names
    # children finish before their parent: the most specific module comes first
    assert names.index("model.layers.1.mlp.down_proj") < names.index("model.layers.1.mlp")
    assert all(m["max_abs"] == 0.0 and m["rel"] == 0.0 for m in report["modules"])


def test_bfloat16_against_float32_within_default_tolerance_but_not_a_tight_one(tiny_dir: Path):
    default = _diff(str(tiny_dir), "--a", "cpu:float32", "--b", "cpu:bfloat16")
    assert default["tolerance"] == 5e-2 and default["first_divergent"] is None
    assert all(0 < m["rel"] < 5e-2 for m in default["modules"])
    tight = _diff(str(tiny_dir), "--b", "cpu:bfloat16", "--tolerance", "1e-4")
    assert tight["first_divergent"] == "model.embed_tokens"


def test_b_model_names_the_perturbed_layer(tiny_dir: Path, tmp_path: Path):
    other = _perturbed_copy(tiny_dir, tmp_path / "b", "model.layers.1.mlp.up_proj.weight")
    report = _diff(str(tiny_dir), "--b", "cpu:float32", "--b-model", str(other))
    assert report["first_divergent"] == "model.layers.1.mlp.up_proj"
    rel = {m["name"]: m["rel"] for m in report["modules"]}
    assert rel["model.layers.1.mlp.gate_proj"] == 0.0 and rel["lm_head"] > 1e-3
    table = CliRunner().invoke(_app, ["diff", str(tiny_dir), "--b", "cpu:float32",
                                      "--b-model", str(other)]).stdout  # fmt: skip
    assert "first module past the tolerance: model.layers.1.mlp.up_proj" in table
    assert "> model.layers.1.mlp.up_proj" in table


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--b", "cdua:float32"], "unknown backend 'cdua': did you mean cuda"),
        (["--b", "cpu:fp8"], "unknown dtype 'fp8'"),
        (["--b", "cpu"], "use BACKEND:DTYPE"),
        (["--b-model", "{tmp}/nothing"], "is not a model directory"),
        (
            ["--b-ops", "cpu"],
            "--b-ops must be 'reference' (the registry's reference ops), got 'cpu'",
        ),
        (["--b-model", "{tmp}/deeper"], "different architectures: num_hidden_layers is 2 vs 3"),
    ],
)
def test_bad_input_is_a_user_error(tiny_dir: Path, tmp_path: Path, args: list[str], message):
    config = json.loads((tiny_dir / "config.json").read_text())
    (tmp_path / "deeper").mkdir()
    (tmp_path / "deeper" / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 3}))
    argv = ["diff", str(tiny_dir), *(a.format(tmp=tmp_path) for a in args)]
    done = CliRunner().invoke(_app, argv)
    assert isinstance(done.exception, UserError) and message in str(done.exception)
    assert "\n" not in str(done.exception)


def test_missing_dir_exits_2_with_one_line(tmp_path: Path):
    done = subprocess.run([GPUCLOUD, "diff", str(tmp_path / "none")], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "is not a model directory" in done.stderr


def test_b_ops_reference_on_a_backend_using_the_reference_does_not_diverge(tiny_dir: Path):
    report = _diff(str(tiny_dir), "--a", "cpu:float32", "--b-ops", "reference")
    assert report["a"] == "cpu:float32" and report["b"] == "cpu:float32 (reference ops)"
    assert report["first_divergent"] is None and report["tolerance"] == 1e-3
    names = [m["name"] for m in report["modules"]]
    assert names[0] == "model.embed_tokens" and "model.layers.1.mlp" in names
    assert all(m["max_abs"] == 0.0 and m["rel"] == 0.0 for m in report["modules"])


def test_b_ops_reference_names_the_module_whose_backend_op_differs(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    # A cpu kernel for silu_and_mul that is 2% off, registered the way a backend registers
    # its kernels; monkeypatch restores the registry's cpu list afterwards.
    monkeypatch.setitem(ops._REGISTRY["silu_and_mul"], "cpu", [])
    ops.register("silu_and_mul", backend="cpu", name="two-percent-off")(
        lambda gate, up: ops.silu_and_mul(gate, up) * 1.02
    )
    report = _diff(str(tiny_dir), "--a", "cpu:float32", "--b-ops", "reference")
    assert report["first_divergent"] == "model.layers.0.mlp.down_proj"
    rel = {m["name"]: m["rel"] for m in report["modules"]}
    assert rel["model.layers.0.mlp.up_proj"] == 0.0 and rel["lm_head"] > 0
    table = CliRunner().invoke(_app, ["diff", str(tiny_dir), "--b-ops", "reference"]).stdout
    assert "cpu:float32 vs cpu:float32 (reference ops)" in table
    assert "first module past the tolerance: model.layers.0.mlp.down_proj" in table
