"""`gpucloud train run --profile-steps` and `gpucloud doctor --trace/--run-dir`: a real tiny
run's profiler trace and metrics, and the bottleneck rules on fabricated metrics."""

from __future__ import annotations

import json

from cli_run import run_cli
from train_helpers import run_config, write_toml

from gpucloud.train.bottlenecks import diagnose
from gpucloud.train.profiling import trace_path
from gpucloud.train.trace_summary import read_events, top_ops


def _step(step: int, **kw) -> dict:
    return {"step": step, "step_time_s": 1.0, "tokens_per_s": 65536.0, "data_time_s": 0.01,
            "sync_time_s": 0.02, "mfu": 0.45, "memory_bytes": 10 << 30} | kw  # fmt: skip


def test_a_healthy_run_has_nothing_to_report():
    (check,) = diagnose([_step(s) for s in range(1, 9)])
    assert check.status == "OK" and check.detail.startswith("nothing stands out: 8 logged steps")


def test_each_bottleneck_is_named_with_its_evidence():
    records = [
        _step(s, data_time_s=0.4, sync_time_s=0.3, memory_bytes=(10 << 30) + s * (400 << 20))
        for s in range(1, 9)
    ] + [
        {"step": 5, "event": "skip", "reason": "overflow"},
        {"step": 7, "event": "rollback", "reason": "nan"},
        {"step": 7, "event": "rollback", "bad_step": 7},
    ]
    log = "step 3 ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    found = {c.name: c for c in diagnose(records, log)}
    assert set(found) == {"input pipeline stall", "communication", "memory growth",
                          "NaN/overflow history", "out of memory"}  # fmt: skip
    assert found["input pipeline stall"].detail.startswith(
        "reading batches took 40% of each step (0.400 s of 1.000 s"
    )
    assert found["communication"].detail.startswith("collectives after backward took 30%")
    assert "from 11.17 GiB (step 3) to 13.12 GiB (step 8), 400.0 MiB per step" in (
        found["memory growth"].detail
    )
    assert found["NaN/overflow history"].detail == (
        "overflow at step(s) 5; nan at step(s) 7; rollback at step(s) 7"
    )
    assert "CUDA out of memory" in found["out of memory"].detail
    assert all(c.status == "WARN" and c.fix for c in found.values())


def test_small_batches_are_named_when_the_device_idles():
    (check,) = diagnose([_step(s, tokens_per_s=2048.0, mfu=0.05) for s in range(1, 5)])
    assert (check.name, check.detail) == (
        "small batches",
        "2,048 tokens per step, MFU 5.0%: fixed per-step costs dominate",
    )


def test_self_time_subtracts_what_an_op_called():
    def op(cat, name, tid, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}

    events = [
        op("cpu_op", "aten::linear", 1, 0, 100),
        op("cpu_op", "aten::addmm", 1, 10, 80),  # called by aten::linear
        op("cpu_op", "aten::relu", 2, 20, 30),  # another thread: not nested
        op("kernel", "gemm", 7, 15, 60),
    ]
    ops = {(o.name, o.kind): (o.calls, round(o.self_seconds * 1e6), round(o.share, 3))
           for o in top_ops(events)}  # fmt: skip
    assert ops == {
        ("aten::addmm", "host"): (1, 80, 0.615),
        ("aten::relu", "host"): (1, 30, 0.231),
        ("aten::linear", "host"): (1, 20, 0.154),
        ("gemm", "device"): (1, 60, 1.0),
    }


def test_a_profiled_run_writes_a_trace_that_doctor_summarises(
    train_here, dataset, tmp_path, capsys, monkeypatch
):
    cfg = run_config(dataset, "optim.max_steps=3", "logging.profile_steps='2:3'")
    _, records, trainer = train_here(cfg)
    trace = trace_path(trainer.run_dir, 2, 3)
    events = read_events(trace)  # Chrome trace JSON, as Perfetto opens it
    assert any(e["name"] == "step 2" for e in json.loads(trace.read_text())["traceEvents"])
    assert any(o.name.startswith("aten::") for o in top_ops(events))
    steps = [r for r in records if "loss" in r]
    assert all(r["data_time_s"] >= 0 and r["sync_time_s"] >= 0 for r in steps)

    shown = run_cli(capsys, monkeypatch, "doctor", "--trace", str(trace), "--top", "5")
    assert shown.returncode == 0, shown.stderr
    assert "Top ops by self time" in shown.stdout and "aten::" in shown.stdout
    report = run_cli(capsys, monkeypatch, "doctor", "--run-dir", str(trainer.run_dir), "--json")
    names = [c["name"] for c in json.loads(report.stdout)]
    assert "small batches" in names  # 8 sequences of 32 tokens
    bad = run_cli(capsys, monkeypatch, "doctor", "--trace", str(trainer.run_dir / "metrics.jsonl"))
    assert bad.returncode == 2 and "is not a JSON trace" in bad.stderr


def test_profile_steps_on_the_command_line(dataset, tmp_path, capsys, monkeypatch):
    config = write_toml(run_config(dataset), tmp_path / "run.toml")
    ok = run_cli(capsys, monkeypatch, "train", "run", str(config), "--dry-run", "--json",
                 "--profile-steps", "2:3")  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    backwards = run_cli(capsys, monkeypatch, "train", "run", str(config), "--dry-run",
                        "--profile-steps", "3:2")  # fmt: skip
    assert backwards.returncode == 2 and "profile_steps 3:2: A must be <= B" in backwards.stderr
    garbled = run_cli(capsys, monkeypatch, "train", "run", str(config), "--dry-run",
                      "--profile-steps", "10-12")  # fmt: skip
    assert garbled.returncode == 2 and "profile_steps" in garbled.stderr
