"""The training loop on one in-process rank: accumulation, resume, health actions."""

from __future__ import annotations

import math

import torch
from train_helpers import losses, run_config

from gpucloud.train import checkpoint
from gpucloud.train.trainer import Outcome


def _params(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.par.model.state_dict().items()}


def test_four_micro_batches_equal_one_large_batch(train_here, dataset):
    _, small, t_small = train_here(run_config(dataset, "optim.micro_batch=2", "optim.max_steps=3"),
                                   "micro2")  # fmt: skip
    _, large, t_large = train_here(run_config(dataset, "optim.micro_batch=8", "optim.max_steps=3"),
                                   "micro8")  # fmt: skip
    assert t_small.lay.accum == 4 and t_large.lay.accum == 1
    for step, loss in losses(large).items():
        assert math.isclose(losses(small)[step], loss, rel_tol=1e-5)
    a, b = _params(t_small), _params(t_large)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)


def test_resume_from_async_checkpoint_is_bit_exact(train_here, dataset, tmp_path):
    cfg = run_config(dataset, "optim.max_steps=6", "checkpoint.every=3")
    _, full, _ = train_here(cfg, "full")
    # Stop after step 3, then resume in a new trainer from the committed checkpoint.
    _, first, _ = train_here(run_config(dataset, "optim.max_steps=3", "checkpoint.every=3"),
                             "resumed")  # fmt: skip
    ckpts = tmp_path / "resumed" / "checkpoints"
    assert [s for s, _ in checkpoint.committed(ckpts)] == [3]
    _, second, _ = train_here(cfg, "resumed")
    assert any(r.get("event") == "resume" for r in second)
    # The lr schedule depends on max_steps: compare only the steps after the resume.
    resumed = {s: v for s, v in losses(second).items() if s > 3}
    assert resumed == {s: v for s, v in losses(full).items() if s > 3}


def test_a_checkpoint_of_the_nested_optimizer_layout_still_resumes_bit_exact(
    train_here, dataset, tmp_path, monkeypatch
):
    """Checkpoints written before the flat layout (numbered param groups) resume."""
    cfg = run_config(dataset, "optim.max_steps=6", "checkpoint.every=3")
    _, full, _ = train_here(cfg, "full")
    flat_writer = checkpoint.state_dict_of

    def nested_writer(model, opt, layout=None):  # what the earlier version wrote
        return flat_writer(model, opt, checkpoint.NESTED)

    with monkeypatch.context() as m:
        m.setattr(checkpoint, "state_dict_of", nested_writer)
        train_here(run_config(dataset, "optim.max_steps=3", "checkpoint.every=3"), "old")
    path = checkpoint.latest(tmp_path / "old" / "checkpoints")
    assert checkpoint.layout_of(path) is checkpoint.NESTED
    assert checkpoint.layout_of(checkpoint.latest(tmp_path / "full" / "checkpoints")) is (
        checkpoint.FLAT
    )
    _, second, _ = train_here(cfg, "old")
    assert any(r.get("event") == "resume" for r in second)
    resumed = {s: v for s, v in losses(second).items() if s > 3}
    assert resumed == {s: v for s, v in losses(full).items() if s > 3}


def test_half_written_checkpoint_is_ignored_and_removed(train_here, dataset, tmp_path):
    run_dir = tmp_path / "half"
    leftover = checkpoint.step_dir(run_dir / "checkpoints", 7)
    (leftover / "rng").mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"torn")
    outcome, records, trainer = train_here(run_config(dataset, "optim.max_steps=2"), "half")
    assert outcome is Outcome.COMPLETED
    assert not any(r.get("event") == "resume" for r in records)
    assert not leftover.exists()
    assert checkpoint.latest(run_dir / "checkpoints").name == "step-00000002"


def test_nan_skip_discards_the_update_and_continues(train_here, dataset):
    cfg = run_config(dataset, "optim.max_steps=5", "fault.nan_at_step=3", "health.on_nan='skip'")
    outcome, records, _ = train_here(cfg)
    assert outcome is Outcome.COMPLETED
    bad = [r for r in records if r.get("event") == "skip"]
    assert [(r["step"], r["reason"], r["loss"]) for r in bad] == [(3, "nan", None)]
    assert all(math.isfinite(v) for s, v in losses(records).items() if s != 3)


def test_nan_rollback_reloads_and_skips_the_bad_data(train_here, dataset):
    cfg = run_config(dataset, "optim.max_steps=6", "checkpoint.every=2", "fault.nan_at_step=5",
                     "health.on_nan='rollback'")  # fmt: skip
    outcome, records, trainer = train_here(cfg)
    assert outcome is Outcome.COMPLETED
    events = [(r["step"], r["event"]) for r in records if "event" in r]
    assert (5, "rollback") in events  # logged with the failed step
    assert (4, "rollback") in [(r["step"], r["event"]) for r in records if r.get("bad_step")]
    assert (5, "skip_data") in events
    assert trainer.skip_steps == {5}
    assert all(torch.isfinite(p).all() for p in trainer.par.model.parameters())


def test_nan_stop_ends_the_run(train_here, dataset):
    cfg = run_config(dataset, "optim.max_steps=5", "fault.nan_at_step=2", "health.on_nan='stop'")
    outcome, records, trainer = train_here(cfg)
    assert outcome is Outcome.STOPPED
    assert trainer.step == 1
    assert records[-1]["event"] == "stopped"


def test_fsdp_bf16_and_activation_checkpointing_train_on_one_rank(train_here, dataset):
    cfg = run_config(
        dataset,
        "optim.max_steps=2",
        "parallel.strategy='fsdp'",
        "precision.dtype='bf16'",
        "parallel.activation_checkpointing=true",
    )
    outcome, records, _ = train_here(cfg)
    assert outcome is Outcome.COMPLETED
    assert all(math.isfinite(v) for v in losses(records).values())


def test_fp16_uses_loss_scaling(train_here, dataset):
    outcome, records, trainer = train_here(
        run_config(dataset, "optim.max_steps=2", "precision.dtype='fp16'")
    )
    assert outcome is Outcome.COMPLETED
    assert trainer.scaler.enabled and records[0]["loss_scale"] == 2.0**16
    assert all(math.isfinite(v) for v in losses(records).values())


def test_fsdp_optimizer_offload_trains_and_resumes_bit_exact(train_here, dataset, tmp_path):
    """FSDP2's CPUOffloadPolicy (no move on CPU, but the same code path): states stay on
    the host, and a resumed run continues with the same losses as an uninterrupted one."""
    offload = ("parallel.strategy='fsdp'", "parallel.offload_optimizer=true")
    cfg = run_config(dataset, *offload, "optim.max_steps=4", "checkpoint.every=2")
    _, full, trainer = train_here(cfg, "full")
    policy = trainer.par.model._get_fsdp_state()._fsdp_param_group.offload_policy
    assert type(policy).__name__ == "CPUOffloadPolicy"
    state = next(iter(trainer.opt.state.values()))
    assert state["exp_avg"].device.type == "cpu"
    _, first, _ = train_here(run_config(dataset, *offload, "optim.max_steps=2",
                                        "checkpoint.every=2"), "resumed")  # fmt: skip
    assert [s for s, _ in checkpoint.committed(tmp_path / "resumed" / "checkpoints")] == [2]
    _, second, _ = train_here(cfg, "resumed")
    assert any(r.get("event") == "resume" for r in second)
    resumed = {s: v for s, v in losses(second).items() if s > 2}
    assert resumed == {s: v for s, v in losses(full).items() if s > 2}
