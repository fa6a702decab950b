"""The device mesh through the real CLI. Tensor parallel: `examples/train/tiny-fsdp.toml
--set parallel.tp=2 --nproc-per-node 4` trains TP2×DP2 on gloo as data parallelism does,
and its DCP checkpoint resumes under plain data parallelism; the planner's per-GPU model
states for `--tp 2` are what a TP rank of the real split model holds. Tensor parallel ×
FSDP2 × pipeline (3D) on 8 processes trains as one process does, and resumes on one; so
does a pipeline × data-parallel run averaging its replicas (no FSDP) on 4."""

from __future__ import annotations

import json
import math
import shutil
import tomllib
from pathlib import Path

import pytest
from train_helpers import gpucloud, losses, read_metrics, run_config, run_in_process, write_toml

from gpucloud import hardware
from gpucloud.models.llama import LlamaForCausalLM
from gpucloud.models.presets import resolve_spec
from gpucloud.planner import TrainSetup, estimate_training
from gpucloud.train import checkpoint, config, tp
from gpucloud.train.trainer import build_optimizer

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).parents[2] / "examples" / "train" / "tiny-fsdp.toml"
# Smaller steps than the example's, so 20 of them cost little beside process start-up.
SHORT = ("data.seq_len=32", "optim.global_batch=8", "optim.micro_batch=2",
         "optim.max_steps=20", "checkpoint.every=10")  # fmt: skip
# fp32 sums taken in another order (row-parallel partial products, gradients reduced over
# tp and dp groups instead of one group) differ by an ulp or so (~1e-7) per step, and Adam
# carries the difference on; we measured ≤ 4e-8 after 20 steps. 100× that margin, and far
# below what a wrong split (a missing or doubled reduction) changes: the loss by 1e-2 or more.
REL_TOL = 1e-5


def _run(dataset: Path, run_dir: Path, nproc: int, *overrides: str):
    sets = [f"--set={o}" for o in (f"data.path='{dataset}'", *SHORT, *overrides)]
    args = ["train", "run", str(EXAMPLE), *sets, "--nproc-per-node", str(nproc)]
    result = gpucloud(*args, "--run-dir", str(run_dir), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout), read_metrics(run_dir)


def _assert_close(curve: dict[int, float], reference: dict[int, float]) -> None:
    for step, loss in reference.items():
        assert math.isclose(curve[step], loss, rel_tol=REL_TOL), (step, curve[step], loss)


def test_tp2_dp2_follows_data_parallel_and_resumes_under_dp2(dataset, process_group, tmp_path):
    summary, records = _run(dataset, tmp_path / "tp", 4, "parallel.tp=2")
    assert summary["layout"]["dp"] == summary["layout"]["tp"] == 2
    tp_curve = losses(records)
    assert sorted(tp_curve) == list(range(1, 21))

    # The data-parallel reference: the same config on one rank, in this process.
    data = tomllib.loads(EXAMPLE.read_text())
    for item in (f"data.path='{dataset}'", *SHORT, "checkpoint.async=false"):
        config.apply_override(data, item)
    _, reference, _ = run_in_process(data, tmp_path / "dp1")
    _assert_close(tp_curve, losses(reference))

    # DCP stores whole tensors by their HF names, whatever the split that wrote them.
    saved = checkpoint.step_dir(tmp_path / "tp" / "checkpoints", 10)
    meta = checkpoint.reader(saved).read_metadata().state_dict_metadata
    assert list(meta["model.model.embed_tokens.weight"].size) == [2048, 64]
    assert list(meta["model.model.layers.0.self_attn.k_proj.weight"].size) == [32, 64]

    # Save TP2×DP2, resume DP2 (FSDP2 alone): the next losses are those of the TP run.
    resumed_dir = tmp_path / "dp2"
    shutil.copytree(saved, checkpoint.step_dir(resumed_dir / "checkpoints", 10))
    _, resumed = _run(dataset, resumed_dir, 2)
    assert [r["step"] for r in resumed if r.get("event") == "resume"] == [10]
    resumed_curve = losses(resumed)
    assert sorted(resumed_curve) == list(range(11, 21))
    _assert_close(resumed_curve, {s: v for s, v in tp_curve.items() if s > 10})


def _local_bytes(tensors) -> int:
    return sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors)


def test_the_planner_s_tp_model_states_are_what_a_tp_rank_holds(process_group):
    """Rank 0 of a 2-wide tensor-parallel mesh (viewed from this 1-rank group: the split
    takes each rank's slice locally, no collective) after one AdamW step, in fp32."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    spec = resolve_spec("tiny")
    model = LlamaForCausalLM(spec)
    mesh = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("tp",), _init_backend=False)
    tp.parallelize(model, mesh)
    opt = build_optimizer(model, config.OptimConfig(global_batch=8, max_steps=1))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # allocates Adam's m and v
    held = {
        "params_bytes": _local_bytes(model.parameters()),
        "optimizer_bytes": _local_bytes(
            t for state in opt.state.values() for k, t in state.items() if k != "step"
        ),
    }
    setup = TrainSetup(hardware.get("H100-SXM"), gpus_per_node=2, tp=2, precision="fp32")
    planned = estimate_training(spec, setup).to_dict()["per_gpu"]
    assert held["params_bytes"] < spec.num_params * 4 * 0.51  # really split
    for key, value in held.items():
        assert math.isclose(planned[key], value, rel_tol=0.10), (key, planned[key], value)


def test_pp2_fsdp2_tp2_on_8_processes_trains_as_one_process_does_and_resumes_on_one(
    dataset, train_here, tmp_path
):
    """3D, TP × FSDP2 × PP: two FSDP2 shards of each stage of a 2-stage 1F1B pipeline whose
    stages are split over 2 tensor-parallel ranks. Each shard group reads half of every
    step's samples; torch's stage reduce-scatters a stage's gradients once after the last
    micro-batch; the tied embedding's are summed over each replica's first and last stage,
    and neighbouring stages pass slices of the sequence. Its DCP checkpoint resumes under
    another layout (one process) with the same next losses."""
    run = ("optim.max_steps=8", "checkpoint.every=4")
    mesh = ("parallel.pp=2", "parallel.tp=2", "parallel.dp_shard=2")
    toml = write_toml(run_config(dataset, *run, *mesh), tmp_path / "3d.toml")
    run_dir = tmp_path / "3d"
    args = ["train", "run", str(toml), "--nproc-per-node", "8", "--run-dir", str(run_dir)]
    result = gpucloud(*args, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    lay = json.loads(result.stdout)["layout"]
    assert (lay["pp"], lay["dp"], lay["tp"], lay["accum"]) == (2, 2, 2, 2)
    _, single, _ = train_here(run_config(dataset, *run), "single")
    reference = losses(single)
    _assert_close(losses(read_metrics(run_dir)), reference)

    # Save TP × FSDP2 × PP, resume on one process: the next losses are the same.
    resumed_dir = tmp_path / "one"
    saved = checkpoint.step_dir(run_dir / "checkpoints", 4)
    shutil.copytree(saved, checkpoint.step_dir(resumed_dir / "checkpoints", 4))
    _, resumed, _ = train_here(run_config(dataset, *run), "one")
    assert [r["step"] for r in resumed if r.get("event") == "resume"] == [4]
    assert sorted(losses(resumed)) == [5, 6, 7, 8]
    _assert_close(losses(resumed), {s: v for s, v in reference.items() if s > 4})


def test_pp2_dp2_averaging_replicas_on_4_processes_trains_as_one_process_does(
    dataset, train_here, tmp_path
):
    """PP × DP without FSDP: two replicas of a 2-stage 1F1B pipeline, each on half of every
    step's samples, a stage's gradients averaged over its replicas in one all-reduce after
    the last micro-batch (DDP-style: whole parameters on every replica) and the tied
    embedding's summed over each replica's first and last stage. The losses follow one
    process's within REL_TOL: we measured ≤ 3.3e-8 over the 8 steps; without the average
    (each replica stepping on its own half) step 2 is 1.8e-3 off. (A sum in place of the
    average would pass: AdamW's update does not change when every gradient doubles.)"""
    run = ("optim.max_steps=8", "checkpoint.every=8")
    toml = write_toml(run_config(dataset, *run, "parallel.pp=2"), tmp_path / "pp-dp.toml")
    run_dir = tmp_path / "pp-dp"
    args = ["train", "run", str(toml), "--nproc-per-node", "4", "--run-dir", str(run_dir)]
    result = gpucloud(*args, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    lay = summary["layout"]
    assert (lay["pp"], lay["dp"], lay["tp"], lay["accum"]) == (2, 2, 1, 2)
    assert config.parse(tomllib.loads(toml.read_text())).parallel.strategy == "ddp"
    curve = losses(read_metrics(run_dir))
    assert sorted(curve) == list(range(1, 9))
    _, single, _ = train_here(run_config(dataset, *run), "single")
    _assert_close(curve, losses(single))
