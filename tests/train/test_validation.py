"""`[eval] every = N`: the run logs `val_loss` on the prepared dataset's val split beside the
training loss, computed as the mean loss over fixed val windows, and training itself is
exactly what it is without evaluations."""

from __future__ import annotations

import pytest
import torch
from train_helpers import losses, run_config

from gpucloud.errors import ConfigError
from gpucloud.train import config
from gpucloud.train.data import TokenWindows, read_info
from gpucloud.train.parallel import loss_fn


def val_losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


def test_val_loss_is_logged_every_n_steps_and_changes_nothing_else(train_here, dataset):
    _, plain, _ = train_here(run_config(dataset), "plain")
    cfg = run_config(dataset, "eval.every=3", "eval.batches=2")
    _, records, trainer = train_here(cfg, "evaluated")
    got = val_losses(records)
    assert list(got) == [3, 6, 8]  # every 3 steps and at the last one
    assert losses(records) == losses(plain)  # bit-exact: evaluating draws and changes nothing
    assert got[8] < got[3]  # the model learns, and the val split shows it
    # The last value is the model's mean loss over the first 2 micro-batches of val windows.
    windows = TokenWindows(read_info(dataset), 32, 0, split="val")
    model = trainer.par.module.eval()
    with torch.no_grad():
        want = [loss_fn(model(t[:, :-1]), t[:, 1:]).item()
                for t in (torch.from_numpy(windows.batch(b * 2, 2)) for b in range(2))]  # fmt: skip
    assert got[8] == pytest.approx(sum(want) / 2, abs=1e-6)
    train = TokenWindows(read_info(dataset), 32, 0)
    assert not torch.equal(
        torch.from_numpy(train.batch(0, 2)), torch.from_numpy(windows.batch(0, 2))
    )


def test_eval_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="eval.every: Input should be greater than or equal to 0"):
        config.parse(run_config("data", "eval.every=-1"))
    with pytest.raises(ConfigError, match="eval.evry: unknown key"):
        config.parse(run_config("data", "eval.evry=5"))
    with pytest.raises(ConfigError, match="eval.every needs the whole model on each rank"):
        config.parse(run_config("data", "eval.every=5", "parallel.pipeline_stages=2"))
