"""Real 2-process runs through `gpucloud train` and torchrun (gloo): every strategy (DDP,
FSDP2, GPipe and 1F1B pipelines) trains, survives a kill -9 with identical losses, and a
NaN rollback works under the pipeline; FSDP2 with SIGTERM, export; a run whose node dies
resumes on another node from checkpoints on S3 (a real moto server)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time

import pytest
import torch
from s3_helpers import s3_server
from train_helpers import GPUCLOUD, gpucloud, losses, read_metrics, run_config, write_toml

from gpucloud.train import checkpoint
from gpucloud.train.export import export

pytestmark = pytest.mark.timeout(300)

STRATEGIES = {
    "ddp": (),
    # FSDP's forward is a collective: validation runs on every rank together.
    "fsdp": ("parallel.strategy='fsdp'", "eval.every=8"),
    "gpipe": ("parallel.pipeline_stages=2", "parallel.pipeline_schedule='gpipe'"),
    "1f1b": ("parallel.pipeline_stages=2", "parallel.pipeline_schedule='1f1b'"),
}
RUN = ("optim.max_steps=16", "checkpoint.every=4")


def _train(cfg: dict, run_dir, *extra: str, **kw) -> subprocess.CompletedProcess:
    toml = write_toml(cfg, run_dir.parent / f"{run_dir.name}.toml")
    args = ["train", "run", str(toml), "--run-dir", str(run_dir), "--nproc-per-node", "2"]
    return gpucloud(*args, *extra, "--json", **kw)


def _failure(result: subprocess.CompletedProcess) -> str:
    """The first traceback of a failed run (its root cause), then the end of stderr."""
    lines = result.stderr.splitlines()
    start = next((i for i, line in enumerate(lines) if "Traceback" in line), len(lines))
    return "\n".join([*lines[start : start + 40], "...", *lines[-15:]])


def _val_losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def uninterrupted(dataset, tmp_path_factory):
    """uninterrupted(strategy) → (run dir, CLI result) of a 16-step run that nothing
    disturbs; each strategy trains once per module, on first use."""
    runs = {}

    def get(strategy: str):
        if strategy not in runs:
            run_dir = tmp_path_factory.mktemp(strategy) / "run"
            result = _train(run_config(dataset, *RUN, *STRATEGIES[strategy]), run_dir)
            assert result.returncode == 0, _failure(result)
            runs[strategy] = run_dir, result
        return runs[strategy]

    return get


def test_ddp_trains_logs_and_keeps_the_newest_checkpoints(uninterrupted):
    run_dir, result = uninterrupted("ddp")
    summary = json.loads(result.stdout)
    assert summary["status"] == {"outcome": "completed", "step": 16, "attempt": 0}
    assert summary["layout"] == {"world_size": 2, "dp": 2, "pp": 1, "tp": 1, "micro_batch": 2,
                                 "accum": 2, "sequences_per_step": 8}  # fmt: skip
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 17))
    for key in ("grad_norm", "lr", "tokens_per_s", "step_time_s", "memory_bytes"):
        assert all(r[key] > 0 for r in records), key
    curve = losses(records)
    assert _mean(curve[s] for s in (14, 15, 16)) < _mean(curve[s] for s in (1, 2, 3)) - 0.3
    kept = [s for s, _ in checkpoint.committed(run_dir / "checkpoints")]
    assert kept == [8, 12, 16]  # keep = 3


def test_the_console_shows_one_progress_line_per_logged_step(uninterrupted):
    """Output captured (not a terminal): plain lines on stderr, stdout stays the JSON."""
    run_dir, result = uninterrupted("ddp")
    line = re.compile(r"step (\d+)/16  loss (\d+\.\d{4})  tokens/s ([\d,]+)  eta \d+:\d\d:\d\d")
    shown = [m for m in map(line.fullmatch, result.stderr.splitlines()) if m]
    logged = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [int(m[1]) for m in shown] == [r["step"] for r in logged] == list(range(1, 17))
    assert [m[2] for m in shown] == [f"{r['loss']:.4f}" for r in logged]
    assert all(int(m[3].replace(",", "")) > 0 for m in shown)


def test_fsdp_logs_val_loss_beside_the_training_loss(uninterrupted):
    run_dir, result = uninterrupted("fsdp")
    val = _val_losses(read_metrics(run_dir))
    assert list(val) == [8, 16] and val[16] < val[8]
    shown = [line for line in result.stderr.splitlines() if "val_loss" in line]
    assert shown == [f"step {s}/16  val_loss {v:.4f}" for s, v in val.items()]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_kill_9_of_a_worker_resumes_with_identical_losses(strategy, uninterrupted, dataset,
                                                          tmp_path):  # fmt: skip
    reference_dir, _ = uninterrupted(strategy)
    run_dir = tmp_path / "killed"
    cfg = run_config(dataset, *RUN, *STRATEGIES[strategy], "fault.kill_at_step=10",
                     "fault.kill_rank=1")  # fmt: skip
    result = _train(cfg, run_dir)
    assert result.returncode == 0, _failure(result)
    records = read_metrics(run_dir)
    resumes = [r for r in records if r.get("event") == "resume"]
    assert len(resumes) == 1 and resumes[0]["attempt"] == 1 and resumes[0]["step"] in (4, 8)
    assert f"step {resumes[0]['step']}: resume (attempt 1)" in result.stderr.splitlines()
    # Every step, including those replayed after the restart, is bit-for-bit the same.
    assert losses(records) == losses(read_metrics(reference_dir))
    assert _val_losses(records) == _val_losses(read_metrics(reference_dir))  # fsdp's


def test_nan_rollback_under_the_pipeline_reloads_and_skips_the_bad_data(uninterrupted, dataset,
                                                                        tmp_path):  # fmt: skip
    reference_dir, _ = uninterrupted("1f1b")
    run_dir = tmp_path / "rollback"
    cfg = run_config(dataset, *RUN, *STRATEGIES["1f1b"], "fault.nan_at_step=10",
                     "health.on_nan='rollback'")  # fmt: skip
    result = _train(cfg, run_dir)
    assert result.returncode == 0, _failure(result)
    records = read_metrics(run_dir)
    events = [(r["step"], r["event"], r.get("bad_step")) for r in records if "event" in r]
    # The failed step is logged (loss null, reason nan), then the reload to step 8.
    assert events == [(10, "rollback", None), (8, "rollback", 10), (10, "skip_data", None),
                      (16, "completed", None)]  # fmt: skip
    # Reloaded model and optimizer: step 9 replays exactly; later steps are finite.
    reference = losses(read_metrics(reference_dir))
    curve = losses(records)
    assert {s: curve[s] for s in range(1, 10)} == {s: reference[s] for s in range(1, 10)}
    assert curve.pop(10) is None and sorted(curve) == [s for s in range(1, 17) if s != 10]
    assert all(math.isfinite(loss) for loss in curve.values())


def test_fsdp_sigterm_saves_and_exports_for_transformers(dataset, tmp_path):
    """FSDP2 trains; SIGTERM to `gpucloud train` saves a checkpoint and exits 143 (resuming
    from such a checkpoint is what the kill -9 test checks); export loads in transformers."""
    import transformers

    from gpucloud.models.loader import load_model

    run_dir = tmp_path / "fsdp"
    cfg = run_config(dataset, "optim.max_steps=80", "optim.warmup_steps=2",
                     "checkpoint.every=100", "parallel.strategy='fsdp'")  # fmt: skip
    toml = write_toml(cfg, tmp_path / "fsdp.toml")
    cmd = [*GPUCLOUD, "train", "run", str(toml), "--run-dir", str(run_dir), "--nproc-per-node", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count('"loss"') >= 12):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["outcome"] == "terminated" and 12 <= status["step"] < 80
    assert checkpoint.latest(run_dir / "checkpoints").name == f"step-{status['step']:08d}"
    curve = losses(read_metrics(run_dir))
    assert sorted(curve) == list(range(1, status["step"] + 1))
    last = status["step"]
    assert (
        _mean(curve[s] for s in (last - 2, last - 1, last))
        < _mean(curve[s] for s in (1, 2, 3)) - 0.3
    )

    out = tmp_path / "exported"
    assert export(run_dir, out)["step"] == status["step"]  # the CLI's `train export`, in-process
    ours = load_model(out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 17, 300, 42, 1999, 5, 7, 8]])
    with torch.no_grad():
        assert torch.equal(ours(ids), theirs(ids).logits)
    tokens = transformers.AutoTokenizer.from_pretrained(out)("Return the sum.")["input_ids"]
    assert len(tokens) > 1


def test_pipeline_1f1b_matches_a_single_process_run(uninterrupted, dataset, train_here):
    run_dir, result = uninterrupted("1f1b")
    assert json.loads(result.stdout)["layout"]["pp"] == 2
    piped = losses(read_metrics(run_dir))
    _, single, _ = train_here(run_config(dataset, *RUN), "single")
    for step, loss in losses(single).items():
        assert math.isclose(piped[step], loss, rel_tol=1e-5), (step, piped[step], loss)
    keys = checkpoint.saved_keys(checkpoint.latest(run_dir / "checkpoints"))
    assert {"model.model.embed_tokens.weight", "model.model.layers.1.mlp.up_proj.weight",
            "model.lm_head.weight"} <= keys  # fmt: skip


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


def test_a_run_whose_node_died_resumes_on_another_node_from_s3(uninterrupted, dataset, s3,
                                                                tmp_path):  # fmt: skip
    """Dataset and checkpoints on S3. Node A dies after step 10 (no in-place restart); node
    B, with its own run dir and storage cache, ignores a torn step left on S3, resumes from
    the newest committed one and ends exactly as the run nothing disturbed."""
    reference_dir, _ = uninterrupted("ddp")
    data_url = s3.upload(dataset, s3.bucket("data") + "/stdlib")
    ckpt = s3.bucket("ckpt") + "/run1"
    on_s3 = (f"data.path='{data_url}'", f"checkpoint.dir='{ckpt}'")
    dying = run_config(dataset, *RUN, *on_s3, "fault.kill_at_step=10", "launch.max_restarts=0")
    assert _train(dying, tmp_path / "node-a").returncode == 1
    saved = [step for step, _ in checkpoint.committed(ckpt)]
    assert saved and set(saved) <= {4, 8}
    s3.filesystem().pipe_file(f"{ckpt}/step-00000012/__1_0.distcp", b"torn: no .metadata")

    node_b = {**os.environ, "GPUCLOUD_STORAGE_CACHE": str(tmp_path / "node-b-cache")}
    result = _train(run_config(dataset, *RUN, *on_s3), tmp_path / "node-b", env=node_b)
    assert result.returncode == 0, _failure(result)
    records = read_metrics(tmp_path / "node-b")
    assert [r["step"] for r in records if r.get("event") == "resume"] == [saved[-1]]
    reference = losses(read_metrics(reference_dir))
    assert losses(records) == {s: v for s, v in reference.items() if s > saved[-1]}
    assert [step for step, _ in checkpoint.committed(ckpt)] == [8, 12, 16]
    assert export(ckpt, tmp_path / "exported")["step"] == 16


def test_a_model_dir_on_s3_is_trained_from(dataset, s3, tmp_path):
    from gpucloud.models.loader import init_model_dir

    model_url = s3.upload(init_model_dir("tiny", tmp_path / "tiny"), s3.bucket("models") + "/tiny")
    cfg = run_config(dataset, "optim.max_steps=2")
    cfg["model"] = {"path": model_url}
    toml = write_toml(cfg, tmp_path / "from-s3.toml")
    result = gpucloud("train", "run", str(toml), "--run-dir", str(tmp_path / "run"), "--json")
    assert result.returncode == 0, _failure(result)
    assert json.loads(result.stdout)["status"]["outcome"] == "completed"
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [1, 2]
