"""`gpucloud plan` end to end through the real entry point (`gpucloud.cli.main.app`, which
maps errors to one line and exit code 2): JSON keys in bytes/seconds/dollars, tables, and
no torch import. One test runs the installed `gpucloud` script in a subprocess."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import run_cli

from gpucloud import hardware

GPUCLOUD = str(Path(sys.executable).with_name("gpucloud"))


@pytest.fixture
def run(capsys, monkeypatch):
    return lambda *args: run_cli(capsys, monkeypatch, "plan", *args)


@pytest.fixture
def plan_json(run):
    def invoke(*args: str) -> dict:
        result = run(*args, "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    return invoke


def test_plan_train_json_has_the_documented_keys(plan_json):
    d = plan_json("train", "--model", "llama-2-7b", "--gpu", "A100-80GB", "--gpus", "8",
                  "--nodes", "1", "--zero", "3", "--precision", "bf16", "--micro-batch", "1",
                  "--seq-len", "4096", "--recompute", "full")  # fmt: skip
    assert d["params"] == 6738415616
    g = d["per_gpu"]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                "total_bytes"):  # fmt: skip
        assert isinstance(g[key], int) and g[key] > 0
    assert d["fits"] is True
    assert d["step_time_s"] > 0 and d["tokens_per_s"] > 0
    assert d["conventions"]["model_states"]["formula"] == "16Φ/N"
    assert d["conventions"]["deepspeed_estimator"]["bytes"] > g["model_states_bytes"]


def test_plan_serve_json_has_the_documented_keys(plan_json):
    d = plan_json("serve", "--model", "llama-3-8b", "--gpu", "L40S", "--quant", "int4",
                  "--max-seq-len", "8192", "--tp", "1")  # fmt: skip
    for key in ("weights_bytes", "kv_bytes_per_token", "max_tokens_in_cache",
                "max_concurrent_seqs"):  # fmt: skip
        assert d[key] > 0
    assert d["fits"] is True


def test_plan_recommend_lists_options_and_rejections(plan_json):
    d = plan_json("recommend", "--model", "llama-3-70b", "--task", "serve", "--concurrency",
                  "64", "--max-seq-len", "4096")  # fmt: skip
    assert d["options"] and d["rejected"]
    assert all(o["fits"] for o in d["options"])


def test_hygon_dcu_and_cambricon_mlu_are_planned_and_priced(plan_json, run):
    for gpu, name in (("mlu370", "MLU370-X8"), ("K100-AI", "K100-AI")):
        d = plan_json("train", "--model", "llama-2-7b", "--gpu", gpu, "--gpus", "8",
                      "--zero", "3", "--seq-len", "4096", "--recompute", "full")  # fmt: skip
        assert d["setup"]["gpu"] == name and d["fits"] is True and d["tokens_per_s"] > 0
    slow = plan_json("serve", "--model", "llama-3-8b", "--gpu", "Z100L", "--quant", "int8")
    fast = plan_json("serve", "--model", "llama-3-8b", "--gpu", "MLU590", "--quant", "int8")
    assert slow["fits"] and fast["fits"]
    assert fast["decode_tokens_per_s"] > slow["decode_tokens_per_s"]
    assert fast["usd_per_hour"] == hardware.get("MLU590").price_per_hour
    fp8 = run("serve", "--model", "llama-3-8b", "--gpu", "MLU590", "--quant", "fp8")
    assert fp8.returncode == 2 and "fp8" in fp8.stderr


def test_tables_by_default(run):
    out = run("train", "--model", "tiny", "--gpu", "L4").stdout
    assert "model states" in out and "fits" in out
    out = run("serve", "--model", "llama-3-8b", "--gpu", "L4").stdout
    assert "KV per token" in out and "concurrent sequences" in out


def test_plan_train_with_ep_shows_the_expert_all_to_all(run, plan_json):
    args = ("train", "--model", "mixtral-8x7b", "--gpu", "H100", "--gpus", "8", "--zero", "3")
    assert "expert all-to-all" not in run(*args).stdout
    assert "expert all-to-all" in run(*args, "--ep", "8").stdout
    ep1, ep8 = plan_json(*args), plan_json(*args, "--ep", "8")
    assert ep1["all_to_all_s"] == 0 < ep8["all_to_all_s"] <= ep8["exposed_comm_s"]
    assert ep8["comm_bytes_per_gpu"] < ep1["comm_bytes_per_gpu"]


def test_a_model_that_does_not_fit_is_a_plan_not_an_error(run):
    result = run("train", "--model", "llama-3-70b", "--gpu", "L4", "--json")
    assert result.returncode == 0
    d = json.loads(result.stdout)
    assert d["fits"] is False and d["shortfall_bytes"] > 0
    assert "does not fit" in run("train", "--model", "llama-3-70b", "--gpu", "L4").stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--model", "llama-2-7", "--gpu", "H100"], "did you mean llama-2-7b"),
        (["train", "--model", "tiny", "--gpu", "H10"], "unknown GPU type 'H10'"),
        (["serve", "--model", "tiny", "--gpu", "A100-8GB"], "did you mean A100-80GB"),
        (["serve", "--model", "tiny", "--gpu", "MLU37-X8"], "did you mean MLU370-X8"),
        (["train", "--model", "tiny", "--gpu", "H100", "--zero", "4"], "--zero must be 0, 1, 2"),
        (["train", "--model", "llama-2-7b", "--gpu", "H100", "--gpus", "8", "--tp", "3"],
         "--tp 3 must divide --gpus 8"),
        (["serve", "--model", "llama-3-8b", "--gpu", "H100", "--tp", "3"],
         "--tp 3 must divide the 32 attention heads"),
        (["recommend", "--model", "tiny", "--task", "cook"], "--task must be one of"),
        (["train", "--model", "mixtral-8x7b", "--gpu", "H100", "--gpus", "8", "--ep", "3"],
         "--ep 3 must divide the data-parallel degree (8"),
        (["train", "--model", "mixtral-8x7b", "--gpu", "H100", "--gpus", "6", "--ep", "6"],
         "--ep 6 must divide the 8 experts per layer of mixtral-8x7b"),
        (["train", "--model", "llama-2-7b", "--gpu", "H100", "--gpus", "2", "--ep", "2"],
         "llama-2-7b is dense"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_code_2(run, args, message):
    result = run(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_kv_heads_not_dividing_heads_is_a_one_line_error(run, tmp_path):
    cfg = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 256,
           "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
           "num_key_value_heads": 3}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    result = run("serve", "--model", str(tmp_path), "--gpu", "L4")
    assert result.returncode == 2
    assert "num_key_value_heads (3) must divide num_attention_heads (8)" in result.stderr


def test_the_installed_script_exits_2_on_bad_input():
    args = [GPUCLOUD, "plan", "train", "--model", "tiny", "--gpu", "H100", "--zero", "7"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --zero must be 0, 1, 2 or 3 (got 7)"


def test_planner_and_plan_command_do_not_import_torch():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from gpucloud.cli.main import _app\n"
        "import gpucloud.planner\n"
        "r = CliRunner().invoke(_app, ['plan', 'train', '--model', 'tiny', '--gpu', 'L4',"
        " '--json'])\n"
        "assert r.exit_code == 0, r.output\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
