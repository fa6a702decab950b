"""Health verdicts, the fp16 loss scaler, the metrics endpoint, and the example configs."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from gpucloud.train import config
from gpucloud.train.config import HealthConfig
from gpucloud.train.health import Action, HealthMonitor, LossScaler
from gpucloud.train.metrics import METRICS_FILE, PORT_FILE, MetricsLog, mfu

EXAMPLES = Path(__file__).parents[2] / "examples" / "train"


def test_nan_and_spikes_get_the_configured_actions():
    monitor = HealthMonitor(HealthConfig(on_nan="rollback", on_spike="skip", spike_factor=3,
                                         spike_window=3))  # fmt: skip
    assert monitor.check(float("nan"), 1.0).action is Action.ROLLBACK
    assert monitor.check(2.0, float("inf")).action is Action.ROLLBACK
    assert monitor.check(2.0, float("inf"), overflow_expected=True).reason == "overflow"
    for norm in (1.0, 1.2, 0.8):  # fills the window: no spike verdicts before it is full
        assert monitor.check(2.0, norm * 10).action is Action.OK
    assert monitor.check(2.0, 29.0).action is Action.OK  # below 3 × mean(10, 12, 8)
    verdict = monitor.check(2.0, 100.0)
    assert (verdict.action, verdict.reason) == (Action.SKIP, "spike")
    assert 100.0 not in monitor.recent  # a spike does not raise the bar for the next one


def test_spikes_are_ignored_by_default():
    monitor = HealthMonitor(HealthConfig(spike_window=2))
    for norm in (1.0, 1.0, 1000.0):
        assert monitor.check(1.0, norm).action is Action.OK


def test_loss_scaler_halves_on_overflow_and_grows_after_clean_steps():
    scaler = LossScaler(enabled=True, init_scale=1024.0, interval=3)
    scaler.update(overflow=True)
    assert scaler.scale == 512.0
    for _ in range(3):
        scaler.update(overflow=False)
    assert scaler.scale == 1024.0
    restored = LossScaler(enabled=True)
    restored.load_state_dict(scaler.state_dict())
    assert restored.scale == 1024.0
    assert LossScaler(enabled=False).scale == 1.0


def test_metrics_go_to_jsonl_and_prometheus(tmp_path):
    log = MetricsLog(tmp_path, enabled=True, max_steps=10, port=0)
    try:
        log.write({"step": 3, "loss": 2.5, "grad_norm": float("nan"), "event": "skip"})
        port = int((tmp_path / PORT_FILE).read_text())
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    finally:
        log.close()
    assert "gpucloud_train_loss 2.5" in body.decode()
    assert "gpucloud_train_step 3" in body.decode()
    record = json.loads((tmp_path / METRICS_FILE).read_text())
    assert record == {"step": 3, "loss": 2.5, "grad_norm": None, "event": "skip"}


def test_mfu_needs_a_peak():
    assert mfu(1000.0, 6e6, None, 2) is None
    assert mfu(1000.0, 6e6, 1e10, 2) == pytest.approx(0.3)


@pytest.mark.parametrize("name", ["tiny-ddp.toml", "tiny-fsdp.toml", "tiny-pipeline.toml"])
def test_example_configs_are_valid(name):
    cfg = config.load(EXAMPLES / name)
    assert cfg.optim.max_steps >= 40 and cfg.logging.every == 1 and cfg.checkpoint.every <= 10
    assert config.layout(cfg, 2).sequences_per_step == cfg.global_batch
