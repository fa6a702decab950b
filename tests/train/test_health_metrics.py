"""Health verdicts, the fp16 loss scaler, the metrics endpoint, and the example configs."""

from __future__ import annotations

import io
import json
import urllib.request
from pathlib import Path

import pytest

from gpucloud.train import config
from gpucloud.train.config import HealthConfig
from gpucloud.train.health import Action, HealthMonitor, LossScaler
from gpucloud.train.metrics import (
    METRICS_FILE,
    PORT_FILE,
    MetricsFollower,
    MetricsLog,
    StepClock,
    mfu,
)

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
    log = MetricsLog(tmp_path, enabled=True, port=0)
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


def test_a_follower_sees_whole_records_appended_after_it_started(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "loss": 3.0}\n')  # an earlier attempt's: not news
    follower = MetricsFollower(path)
    assert follower.new_records() == []
    with path.open("a") as f:
        f.write('{"step": 2, "loss": 2.5}\n{"step": 3, "lo')
        f.flush()
        assert follower.new_records() == [{"step": 2, "loss": 2.5}]
        f.write('ss": 2.25}\n')
    assert follower.new_records() == [{"step": 3, "loss": 2.25}]
    assert MetricsFollower(tmp_path / "absent.jsonl").new_records() == []


def test_time_left_is_the_mean_of_recent_steps_times_the_steps_left():
    clock = StepClock(window=2)
    assert clock.seconds_left(10) == 0.0
    for seconds in (9.0, 1.0, 3.0):  # the slow first step falls out of the window
        clock.add(seconds)
    assert clock.seconds_left(10) == 20.0


def test_mfu_needs_a_peak():
    assert mfu(1000.0, 6e6, None, 2) is None
    assert mfu(1000.0, 6e6, 1e10, 2) == pytest.approx(0.3)


@pytest.mark.parametrize("name", ["tiny-ddp.toml", "tiny-fsdp.toml", "tiny-pipeline.toml"])
def test_example_configs_are_valid(name):
    cfg = config.load(EXAMPLES / name)
    assert cfg.optim.max_steps >= 40 and cfg.logging.every == 1 and cfg.checkpoint.every <= 10
    assert config.layout(cfg, 2).sequences_per_step == cfg.global_batch


def test_a_terminal_gets_a_live_bar_and_a_line_that_stays_per_event(monkeypatch):
    from rich.console import Console

    from gpucloud.cli import train as train_cli

    screen = Console(file=io.StringIO(), force_terminal=True, width=120)
    monkeypatch.setattr(train_cli, "err_console", screen)
    step = {"tokens_per_s": 12345.6, "eta_s": 83.4}
    with train_cli.console_progress(16) as show:
        show({"step": 4, "loss": 2.5, **step})
        show({"step": 4, "event": "resume", "attempt": 1})
        show({"step": 5, "loss": None, **step, "event": "rollback", "reason": "nan"})
        show({"step": 16, "loss": 2.0, **step} | {"eta_s": 0.0})
        show({"step": 16, "event": "completed"})
    text = screen.file.getvalue()
    assert "step 4: resume (attempt 1)\n" in text
    assert "step 5/16  loss -  tokens/s 12,346  eta 0:01:23  rollback (nan)\n" in text
    assert "step 16/16" in text and "loss 2.0000  tokens/s 12,346  eta 0:00:00" in text
    assert "completed" not in text  # the command's last line says how the run ended
