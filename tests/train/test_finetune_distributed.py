"""Fine-tuning on 2 processes through `gpucloud train` and torchrun (gloo): full-weight SFT
under FSDP2 survives a kill -9 with identical losses; full-weight SFT under DDP from a model
and a chat file on S3 learns and names their s3:// URLs as its lineage; LoRA SFT under DDP
exports an adapter our engine loads. (test_finetune.py runs the recipes in process, under
DDP on one rank.)"""

from __future__ import annotations

import json

import pytest
from s3_helpers import s3_server
from test_finetune import ANSWERS, recipe
from train_helpers import gpucloud, losses, read_metrics, write_toml

from gpucloud.models.content import tree_content
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
    the same losses, bit for bit, as the first attempt logged (one run, no reference).
    Saved synchronously: an asynchronous step-4 save may not have committed by step 6 on a
    loaded machine (a full suite run saw that), and the group then rightly starts over."""
    cfg = _sft(base, "parallel.strategy='fsdp'", "fault.kill_at_step=6", "fault.kill_rank=1",
               "checkpoint.async=false")  # fmt: skip
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


def test_full_sft_on_ddp_from_s3_names_the_urls_as_its_lineage(base, tmp_path):
    """The workers read the storage cache's copies; the lineage names what the run was given."""
    from gpucloud.train.lineage import run_lineage

    with s3_server(tmp_path) as s3:
        model_url = s3.upload(base, s3.bucket("models") + "/tiny")
        data_url = s3.bucket("chats") + "/answers.jsonl"
        s3.filesystem().put_file(str(ANSWERS), data_url)
        summary = _train(_sft(base, f"model.path='{model_url}'", f"data.path='{data_url}'"),
                         tmp_path / "full")  # fmt: skip
        lineage = run_lineage(tmp_path / "full")
    assert (summary["layout"]["dp"], summary["status"]["outcome"]) == (2, "completed")
    curve = losses(read_metrics(tmp_path / "full"))
    assert curve[8] < curve[1] - 2.0
    assert (lineage["base_model"], lineage["dataset"], lineage["step"]) == (model_url, data_url, 8)
    assert lineage["train_config"]["model"]["path"] == model_url
    assert lineage["train_config"]["data"]["path"] == data_url
    assert lineage["dataset_hash"] == tree_content(ANSWERS).hash  # the bytes the run read
    assert "storage-cache" not in json.dumps(lineage)


def test_lora_sft_on_ddp_exports_an_adapter_the_engine_loads(base, tmp_path):
    _train(_sft(base, "lora.rank=4", "lora.alpha=8.0"), tmp_path / "lora")
    result = gpucloud("train", "export", str(tmp_path / "lora"), "--out", str(tmp_path / "ad"))
    assert result.returncode == 0, result.stderr
    assert "exported step 8" in result.stdout
    adapter = load_adapter(tmp_path / "ad", ModelSpec.from_dir(base), 8, "answers")
    assert adapter.rank == 4 and len(adapter.weights) == 2 * 4  # 2 layers x q, k, v, o
    curve = losses(read_metrics(tmp_path / "lora"))
    assert curve[8] < curve[1]
