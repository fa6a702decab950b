"""Fine-tuning on 2 processes through `gpucloud train` and torchrun (gloo): full-weight SFT
under FSDP2 survives a kill -9 with identical losses; LoRA SFT under DDP exports an adapter
our engine loads. (test_finetune.py runs the recipes in process, under DDP on one rank.)"""

from __future__ import annotations

import json

import pytest
from test_finetune import ANSWERS, recipe
from train_helpers import gpucloud, losses, read_metrics, write_toml

from gpucloud.models.loader import init_model_dir
from gpucloud.models.lora import load_adapter
from gpucloud.models.spec import ModelSpec

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return init_model_dir("tiny", tmp_path_factory.mktemp("ft-dist") / "tiny", seed=0)


def _train(cfg: dict, run_dir) -> dict:
    toml = write_toml(cfg, run_dir.parent / f"{run_dir.name}.toml")
    result = gpucloud("train", "run", str(toml), "--run-dir", str(run_dir), "--nproc-per-node",
                      "2", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def _sft(base, *overrides: str) -> dict:
    return recipe(base, "sft", "optim.max_steps=8", "checkpoint.every=4", *overrides)


def test_fsdp_sft_resumes_after_kill_9_with_identical_losses(base, tmp_path):
    """Rank 1 dies after step 6; the group restarts from step 4 and replays steps 5 and 6:
    the same losses, bit for bit, as the first attempt logged (one run, no reference)."""
    cfg = _sft(base, "parallel.strategy='fsdp'", "fault.kill_at_step=6", "fault.kill_rank=1")
    summary = _train(cfg, tmp_path / "killed")
    assert summary["status"] == {"outcome": "completed", "step": 8, "attempt": 1}
    records = read_metrics(tmp_path / "killed")
    resume = next(i for i, r in enumerate(records) if r.get("event") == "resume")
    assert (records[resume]["step"], records[resume]["attempt"]) == (4, 1)
    first, replayed = losses(records[:resume]), losses(records[resume:])
    assert sorted(first) == list(range(1, 7)) and sorted(replayed) == [5, 6, 7, 8]
    assert {s: first[s] for s in (5, 6)} == {s: replayed[s] for s in (5, 6)}
    assert replayed[8] < first[1] - 2.0
    assert str(ANSWERS) in (tmp_path / "killed" / "config.json").read_text()


def test_lora_sft_on_ddp_exports_an_adapter_the_engine_loads(base, tmp_path):
    _train(_sft(base, "lora.rank=4", "lora.alpha=8.0"), tmp_path / "lora")
    result = gpucloud("train", "export", str(tmp_path / "lora"), "--out", str(tmp_path / "ad"))
    assert result.returncode == 0, result.stderr
    assert "exported step 8" in result.stdout
    adapter = load_adapter(tmp_path / "ad", ModelSpec.from_dir(base), 8, "answers")
    assert adapter.rank == 4 and len(adapter.weights) == 2 * 4  # 2 layers x q, k, v, o
    curve = losses(read_metrics(tmp_path / "lora"))
    assert curve[8] < curve[1]
