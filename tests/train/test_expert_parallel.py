"""Expert parallelism (`[parallel] ep`): tiny-moe on 2 gloo processes with its 4 experts split
2 + 2 trains as DDP over the same 2 ranks does (each rank holding every expert), under DDP
and under FSDP2, and its DCP checkpoint, every expert saved once by its Hugging Face name,
resumes under ep = 1 with the same next losses. Layouts that cannot work fail before
anything starts."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_finetune import recipe
from train_helpers import losses, read_metrics, run_config

from gpucloud.errors import ConfigError
from gpucloud.models.loader import init_model_dir
from gpucloud.models.presets import resolve_spec
from gpucloud.planner.memory import estimate_training_memory
from gpucloud.train import checkpoint, config, launcher
from gpucloud.train.plan import planner_setup

pytestmark = pytest.mark.timeout(300)

# fp32 sums in another order (an expert's matmul over both ranks' rows at once; its
# gradient summed in the backward instead of by DDP's all-reduce) differ by an ulp or so
# per step, and Adam carries the difference on. A wrong reduction (an expert gradient not
# divided by the data-parallel size, an expert counted twice in the norm) moves the logged
# grad norm by 10% or more and, through clipping, the losses.
REL_TOL = 1e-5
# FSDP2 sums the squares of its shards in another order than DDP's norm: at ep = 1 the two
# grad norms already differ by 1.1e-5 of the norm on the same gradients (measured).
FSDP_NORM_TOL = 1e-4
STEPS = 10


def _moe_run(dataset: Path, ep: int, *overrides: str) -> dict:
    return run_config(
        dataset, "model.preset='tiny-moe'", f"optim.max_steps={STEPS}", "checkpoint.every=5",
        "checkpoint.async=false", "optim.global_batch=4", "moe.capacity_factor=1.0",
        f"parallel.ep={ep}", *overrides,
    )  # fmt: skip


def _train_all(rank: int, world_size: int, root: Path, runs: list[dict]) -> None:
    """One rank: train each run in turn in the same group; record the experts it held."""
    from gpucloud.train.trainer import DistEnv, Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=rank,
                            world_size=world_size)  # fmt: skip
    env = DistEnv(rank, world_size, rank, torch.device("cpu"), "cpu", attempt=0)
    held = []
    try:
        for run in runs:
            run_dir = Path(run["dir"])
            run_dir.mkdir(parents=True, exist_ok=True)
            if rank == 0 and "resume_from" in run:  # a copy of another run's checkpoint
                saved = Path(run["resume_from"])
                shutil.copytree(saved, run_dir / "checkpoints" / saved.name)
            dist.barrier()
            trainer = Trainer(config.parse(run["config"]), run_dir, env)
            trainer.train()
            model = trainer.par.model
            experts = sorted({k.split(".")[5] for k in model.state_dict() if ".experts." in k})
            held.append({"experts": experts, "params": sum(p.numel() for p in model.parameters())})
            dist.barrier()
    finally:
        dist.destroy_process_group()
    (root / f"held{rank}.json").write_text(json.dumps(held))


def _assert_close(curve: dict[int, float], reference: dict[int, float], tol=REL_TOL) -> None:
    for step, value in reference.items():
        assert math.isclose(curve[step], value, rel_tol=tol), (step, curve[step], value)


def _grad_norms(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["grad_norm"] for r in records if "grad_norm" in r}


def test_ep2_trains_as_ddp_and_resumes_under_ep1(dataset, tmp_path):
    ep2, ddp, resumed = tmp_path / "ep2", tmp_path / "ddp", tmp_path / "resumed"
    fsdp_ep2 = tmp_path / "fsdp-ep2"
    saved = checkpoint.step_dir(ep2 / "checkpoints", 5)
    # Recomputing layers in backward changes no number; it renames the parameters DDP must
    # leave out (the experts), which once made DDP broadcast rank 0's experts over rank 1's.
    recompute = "parallel.activation_checkpointing=true"
    runs = [
        {"dir": str(ep2), "config": _moe_run(dataset, 2, recompute)},
        {"dir": str(ddp), "config": _moe_run(dataset, 1)},
        {"dir": str(resumed), "config": _moe_run(dataset, 1), "resume_from": str(saved)},
        {"dir": str(fsdp_ep2), "config": _moe_run(dataset, 2, "parallel.strategy='fsdp'")},
    ]
    mp.start_processes(_train_all, args=(2, tmp_path, runs), nprocs=2, start_method="spawn")

    held = [json.loads((tmp_path / f"held{r}.json").read_text()) for r in range(2)]
    assert [held[0][0]["experts"], held[1][0]["experts"]] == [["0", "1"], ["2", "3"]]
    assert held[0][1]["experts"] == held[1][1]["experts"] == ["0", "1", "2", "3"]
    # The planner's parameters per GPU under ep = 2 are what each rank holds (fp32).
    cfg = config.parse(runs[0]["config"])
    planned = estimate_training_memory(resolve_spec("tiny-moe"), planner_setup(cfg, 2))
    assert planned.stage.params_bytes == 4 * held[0][0]["params"] == 4 * held[1][0]["params"]
    assert held[0][0]["params"] < held[0][1]["params"]

    ep2_records, ddp_records = read_metrics(ep2), read_metrics(ddp)
    ep2_curve = losses(ep2_records)
    assert sorted(ep2_curve) == list(range(1, STEPS + 1))
    _assert_close(ep2_curve, losses(ddp_records))
    _assert_close(_grad_norms(ep2_records), _grad_norms(ddp_records))
    # FSDP2 with each expert its own unit over its replicas (none here) trains alike.
    fsdp_records = read_metrics(fsdp_ep2)
    _assert_close(losses(fsdp_records), losses(ddp_records))
    _assert_close(_grad_norms(fsdp_records), _grad_norms(ddp_records), FSDP_NORM_TOL)
    # Capacity drops the same assignments: each rank routes its own tokens as before.
    dropped = {r["step"]: r["dropped_tokens"] for r in ddp_records if "loss" in r}
    _assert_close({r["step"]: r["dropped_tokens"] for r in ep2_records if "loss" in r}, dropped)
    assert max(dropped.values()) > 0

    # Every expert once, whole, by its HF name, whichever rank wrote it.
    meta = checkpoint.reader(saved).read_metadata().state_dict_metadata
    experts = {k for k in meta if k.startswith("model.") and ".experts." in k}
    assert len(experts) == 2 * 4 * 3  # layers × experts × (w1, w2, w3)
    assert list(meta["model.model.layers.1.block_sparse_moe.experts.3.w2.weight"].size) == [
        64,
        176,
    ]

    # Saved under ep = 2, resumed under ep = 1: the next losses are the ep = 2 run's.
    resumed_records = read_metrics(resumed)
    assert [r["step"] for r in resumed_records if r.get("event") == "resume"] == [5]
    resumed_curve = losses(resumed_records)
    assert sorted(resumed_curve) == list(range(6, STEPS + 1))
    _assert_close(resumed_curve, {s: v for s, v in ep2_curve.items() if s > 5})


@pytest.mark.parametrize(
    ("overrides", "nproc", "message"),
    [
        (["parallel.ep=3"], 2, r"parallel.ep \(3\) must divide the data-parallel size \(2 = "),
        (["parallel.ep=2", "model.preset='tiny'"], 2, "tiny is dense: set parallel.ep = 1"),
        (["parallel.ep=2", "parallel.tp=2", "parallel.strategy='fsdp'"], 4, "dense unquantized"),
        (["parallel.ep=2", "parallel.pp=2"], 4, "set parallel.pipeline_stages = 1"),
    ],
)
def test_ep_layouts_that_cannot_work_fail_before_a_run_starts(dataset, overrides, nproc, message):
    cfg = config.parse(run_config(dataset, "model.preset='tiny-moe'", *overrides))
    with pytest.raises(ConfigError, match=message):
        launcher.preflight(cfg, nproc)


def test_ep_must_divide_the_expert_count(dataset):
    cfg = config.parse(run_config(dataset, "model.preset='tiny-moe'", "parallel.ep=8",
                                  "optim.global_batch=8", "optim.micro_batch=1"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"parallel.ep \(8\) must divide the model's 4 experts"):
        launcher.preflight(cfg, 8)


def test_lora_on_a_moe_model_trains_alike_under_ep2_and_ep1(tmp_path):
    """LoRA fine-tuning of a Mixtral-style model (its experts frozen with the rest of the
    base) with the experts split over 2 ranks: the same losses and grad norms as every rank
    holding every expert (it failed: the frozen experts' gradients, none, were reduced)."""
    base = init_model_dir("tiny-moe", tmp_path / "tiny-moe", seed=0)
    sft = [f"optim.max_steps={STEPS // 2}", "lora.rank=4", "lora.alpha=8.0"]
    runs = [{"dir": str(tmp_path / f"ep{ep}"),
             "config": recipe(base, "sft", *sft, f"parallel.ep={ep}")}
            for ep in (2, 1)]  # fmt: skip
    mp.start_processes(_train_all, args=(2, tmp_path, runs), nprocs=2, start_method="spawn")
    held = [json.loads((tmp_path / f"held{r}.json").read_text()) for r in range(2)]
    assert [held[0][0]["experts"], held[1][0]["experts"]] == [["0", "1"], ["2", "3"]]
    ep2, ep1 = read_metrics(tmp_path / "ep2"), read_metrics(tmp_path / "ep1")
    assert sorted(losses(ep2)) == list(range(1, STEPS // 2 + 1))
    _assert_close(losses(ep2), losses(ep1))
    _assert_close(_grad_norms(ep2), _grad_norms(ep1))
