"""Stragglers and hangs: the rule on fabricated step times, the doctor's findings, the
control plane's reading of the exit code, and one real 2-process gloo run where rank 1 is
first slow (reported as a straggler), then stops before a step: the step's watchdog reports
the hang within the timeout and the run exits 4 instead of waiting forever."""

from __future__ import annotations

import json
import socket

import pytest
import torch.distributed as dist
from train_helpers import gpucloud, read_metrics, run_config, write_toml

from gpucloud.control.executors.base import describe_exit
from gpucloud.train import launcher
from gpucloud.train.bottlenecks import diagnose
from gpucloud.train.stragglers import (
    FORWARD_DONE,
    HUNG_EXIT,
    STARTED,
    Heartbeats,
    StragglerDetector,
    hang_message,
    slow_ranks,
)


def test_a_rank_far_above_the_median_of_its_peers_is_slow():
    assert slow_ranks([0.10, 0.11, 0.35, 0.09], factor=2.0) == [(2, 0.10)]
    assert slow_ranks([0.01, 0.03], factor=2.0) == []  # 3× but only 20 ms more: noise
    assert slow_ranks([0.01, 0.30], factor=2.0) == [(1, 0.01)]  # two ranks: the other's time


def test_a_straggler_is_reported_once_after_k_consecutive_slow_steps_until_it_recovers():
    detector = StragglerDetector(factor=2.0, steps=3, hosts=["a", "b"])
    slow, fast = [0.01, 0.5], [0.01, 0.01]
    seen = [detector.observe(step, times) for step, times in
            enumerate([slow, slow, fast, slow, slow, slow, slow, fast], start=1)]  # fmt: skip
    found = {step: f for step, (f, _) in enumerate(seen, start=1) if f}
    assert list(found) == [6]  # the streak broke at step 3
    (s,) = found[6]
    assert (s.rank, s.host, s.own_time_s, s.peer_median_s) == (1, "b", 0.5, 0.01)
    assert s.record()["event"] == "straggler"
    assert [step for step, (_, back) in enumerate(seen, start=1) if back] == [8]


def test_the_ranks_behind_are_named_from_their_marks_in_the_store():
    store = dist.PrefixStore("t", dist.TCPStore("127.0.0.1", 0, 1, is_master=True))
    beats = [Heartbeats(store, rank, 3, host) for rank, host in enumerate(["a", "b", "c"])]
    beats[0].mark(5, FORWARD_DONE)
    beats[1].mark(5, STARTED)  # rank 2 never marked: stuck before its first step
    behind = beats[0].behind()
    assert behind == [(1, "b", 5, STARTED), (2, "?", 0, STARTED)]
    assert hang_message(5, 600, behind).startswith(
        "step 5 did not finish within 600 s (health.hang_timeout_s): rank 1 on host b last "
        "started step 5; rank 2 on host ? last started step 0; exiting with code 4"
    )
    beats[1].mark(5, FORWARD_DONE)
    beats[2].mark(5, FORWARD_DONE)
    assert beats[2].behind() == []
    assert "no rank is behind the others: a collective itself did not complete" in (
        hang_message(5, 600, [])
    )


def test_doctor_names_the_straggler_and_the_hang():
    steps = [{"step": s, "step_time_s": 1.0, "tokens_per_s": 1e6} for s in range(1, 5)]
    events = [
        {"step": 3, "event": "straggler", "rank": 1, "host": "gpu7", "own_time_s": 0.5,
         "peer_median_s": 0.1},
        {"step": 5, "event": "hang", "timeout_s": 600.0, "behind_ranks": [1],
         "behind_hosts": ["gpu7"]},
    ]  # fmt: skip
    found = {c.name: c for c in diagnose(steps + events)}
    assert found["stragglers"].status == "WARN"
    assert found["stragglers"].detail == (
        "rank 1 on host gpu7 from step 3: 0.500 s of own work per step against a median of "
        "0.100 s among its peers"
    )
    assert (found["hang"].status, found["hang"].detail) == (
        "FAIL",
        "step 5 did not finish within 600 s (1 hang(s)); fell behind: rank 1 on host gpu7",
    )


def test_the_control_plane_says_a_hung_training_job_is_retryable():
    assert launcher.ExitCode.HUNG == HUNG_EXIT
    assert describe_exit(HUNG_EXIT, train=True) == (
        "exit code 4 (a rank hung: retryable, the next attempt resumes from the last checkpoint)"
    )
    assert describe_exit(HUNG_EXIT) == "exit code 4"  # any other command's 4 means nothing


@pytest.mark.timeout(300)
def test_a_slow_rank_is_reported_and_a_stopped_rank_ends_the_run_with_a_report(dataset, tmp_path):
    run_dir = tmp_path / "run"
    cfg = run_config(
        dataset, "optim.max_steps=5", "optim.micro_batch=4", "health.straggler_steps=2",
        "health.hang_timeout_s=3", "fault.slow_rank=1", "fault.slow_seconds=0.2",
        "fault.hang_at_step=5", "fault.hang_rank=1", "launch.max_restarts=0",
    )  # fmt: skip
    toml = write_toml(cfg, tmp_path / "run.toml")
    result = gpucloud("train", "run", str(toml), "--run-dir", str(run_dir),
                      "--nproc-per-node", "2", "--json")  # fmt: skip
    assert result.returncode == 4, result.stderr[-3000:]
    assert json.loads(result.stdout)["status"] == {"outcome": "hung", "step": 4, "attempt": 0}
    host = socket.gethostname()
    records = read_metrics(run_dir)
    straggler, hang = [r for r in records if r.get("event") in ("straggler", "hang")]
    # DDP's second forward re-buckets the gradients (a collective that makes rank 0 wait
    # once), so two consecutive slow steps end at step 3 or 4.
    assert straggler["event"] == "straggler" and straggler["step"] in (3, 4)
    assert (straggler["rank"], straggler["host"]) == (1, host)
    assert straggler["own_time_s"] > 0.2 > straggler["peer_median_s"]
    assert hang == {"step": 5, "event": "hang", "timeout_s": 3.0, "behind_ranks": [1],
                    "behind_hosts": [host]}  # fmt: skip
    # The log names rank and host (rank 0 says it once); the console shows both events.
    assert result.stderr.count(f"rank0 WARNING gpucloud.train.stragglers: rank 1 on host {host} "
                               "is a straggler") == 1  # fmt: skip
    assert (
        f"step 5 did not finish within 3 s (health.hang_timeout_s): rank 1 on host {host} "
        "last started step 5; exiting with code 4"
    ) in result.stderr
    assert f"step 5: hang (timeout_s 3.0, behind_ranks [1], behind_hosts ['{host}'])" in (
        result.stderr
    )
    steps = {r["step"]: r["stragglers"] for r in records if "loss" in r}
    assert steps[1] == 0 and steps[4] == 1
    # `gpucloud doctor --job` reads the same records.
    found = {c.name: c.status for c in diagnose(records)}
    assert (found["stragglers"], found["hang"]) == ("WARN", "FAIL")
