"""The synthetic trace generator and `gpucloud sim sweep` (one policy over many traces)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpucloud.errors import UserError
from gpucloud.scheduler import POLICIES
from gpucloud.scheduler.sim import Trace, TraceJob, load_trace
from gpucloud.scheduler.sim.sweep import (
    auto_cluster,
    parse_spec,
    sweep_one,
    synthetic_traces,
    target_jct,
)
from gpucloud.scheduler.sim.synthetic import DAY, LARGE_GANG_SIZES, synthetic_trace
from scheduler.helpers import BACKLOG

GPUCLOUD = str(Path(sys.executable).with_name("gpucloud"))
ITP03 = Path(__file__).parents[2] / "examples/traces/itp_cluster03.csv"
ITP08 = Path("/work/shared/traces/microsoft_itp_2021/raw/cluster08.csv")


def _sweep(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([GPUCLOUD, "sim", "sweep", *args], capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def test_synthetic_trace_has_the_load_the_tail_and_the_day_it_was_asked_for() -> None:
    kw = {"median_duration": 3600.0, "seed": 4, "arrivals": "diurnal", "durations": "pareto"}
    tr = synthetic_trace(6000, 512, 0.8, LARGE_GANG_SIZES, **kw)
    assert tr.jobs == synthetic_trace(6000, 512, 0.8, LARGE_GANG_SIZES, **kw).jobs
    submit = np.array([j.submit_time for j in tr.jobs])
    dur = np.array([j.duration for j in tr.jobs])
    gpus = np.array([j.num_gpus for j in tr.jobs])
    span = submit[-1] - submit[0]
    assert (dur * gpus).sum() / span / 512 == pytest.approx(0.8, rel=0.05)
    assert np.median(dur) == pytest.approx(3600, rel=0.1)
    assert dur.max() > 100 * np.median(dur)  # heavy tail (log-normal sigma 1.5 rarely does)
    assert {128, 256} <= set(gpus.tolist())  # gangs on 16 and 32 nodes of 8
    hour = (submit % DAY) / 3600
    peak, trough = ((hour >= 3) & (hour < 9)).sum(), ((hour >= 15) & (hour < 21)).sum()
    assert peak > 3 * trough  # sin peaks at 6 h, troughs at 18 h (amplitude 0.8: 9x)
    assert synthetic_trace(200, 64, seed=1).jobs != synthetic_trace(200, 64, seed=2).jobs


def test_bad_generator_input_is_refused() -> None:
    for kwargs in ({"arrivals": "bursty"}, {"pareto_shape": 1.0}, {"diurnal_amplitude": 1.0},
                   {"sizes": {1024: 1.0}}):  # fmt: skip
        with pytest.raises(UserError):
            synthetic_trace(10, 64, **kwargs)


def test_clusters_are_sized_to_the_load_and_the_largest_gang() -> None:
    # 140 GPUs of mean demand over the 1,000 s between first and last arrival
    tr = Trace("t", "test", [TraceJob("a", 0, 8750, 8), TraceJob("b", 1000, 8750, 8)])
    assert auto_cluster(tr, 0.875) == "20x8" and auto_cluster(tr, 0.5) == "35x8"
    big = synthetic_trace(50, 256, 0.01, {256: 1.0}, seed=0)
    assert auto_cluster(big, 0.875) == "32x8"  # load alone asks for 1 node
    assert parse_spec("p.csv@ee9e8c=16x8") == (Path("p.csv"), "ee9e8c", "16x8")
    assert parse_spec("dir/c.csv") == (Path("dir/c.csv"), None, None)


def test_fifo_against_itself_is_one_and_the_bounds_are_below_it() -> None:
    (tr, cluster), = synthetic_traces([7], 400, 0.875)  # fmt: skip
    row = sweep_one(tr, cluster, POLICIES["fifo"], bound_slot=3600.0)
    assert (row.jct_ratio, row.p99_wait_ratio, row.max_wait_ratio) == (1.0, 1.0, 1.0)
    assert row.fifo_max_wait_s > 0 and row.jobs == 400
    assert row.lp_bound_ratio is not None and row.oracle_sjf_ratio is not None
    assert 0 < row.lp_bound_ratio < row.oracle_sjf_ratio < 1
    # the target restated against the bound: 0.5, or 1.1 x a bound above 0.45
    assert row.target_jct_ratio == max(0.5, 1.1 * row.lp_bound_ratio)
    assert not row.target_met  # FIFO's own JCT is 1.0
    assert target_jct(0.587) == pytest.approx(0.6457) and target_jct(None) == 0.5


def test_sweep_prints_one_row_per_trace_and_json() -> None:
    done = _sweep("--trace", f"{ITP03}=20x8", "--synthetic", "0,1", "--synthetic-jobs", "300",
                  "--no-bound", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [r["trace"] for r in rows] == ["itp_cluster03", "synthetic-diurnal-pareto-300-s0",
                                          "synthetic-diurnal-pareto-300-s1"]  # fmt: skip
    assert rows[0]["cluster"] == "20x8 A100-80GB" and rows[0]["jobs"] == 3011
    assert rows[0]["jct_ratio"] < 0.7 and rows[0]["lp_bound_ratio"] is None
    for r in rows:  # without a bound the target is 0.5; met only if all three hold
        met = r["jct_ratio"] <= 0.5 and r["p99_wait_ratio"] <= 1 and r["max_wait_ratio"] <= 1.05
        assert r["target_jct_ratio"] == 0.5 and r["target_met"] == met
    done = _sweep("--synthetic", "3", "--synthetic-jobs", "200", "--no-bound")
    assert done.returncode == 0 and "synthetic-diurnal-pareto-200-s3" in done.stdout
    assert "target JCT" in done.stdout and "met" in done.stdout


def test_bad_sweep_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    for args, msg in (
        (["--synthetic", "a,b"], "write comma-separated integer seeds"),
        (["--synthetic", ""], "nothing to sweep"),
        (["--trace", str(tmp_path)], "holds no .csv trace"),
        (["--policy", "fifoo"], "did you mean fifo"),
        (["--load", "2"], "--load in 0..1"),
    ):
        done = _sweep(*args)
        assert done.returncode == 2, done.stderr
        assert msg in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_the_due_guard_keeps_waits_within_fifos_on_traces_it_was_not_tuned_on() -> None:
    """The guarantee the README states for the `gpucloud` preset and `fsp` (the same due
    guard over GPU-time and duration order: max wait <= 1.05 x FIFO's, p99 wait <= 1.01 x
    FIFO's), on ITP cluster03 and four unseen 3,000-job synthetic traces (held out while
    the guard was designed); the backlog starvation guard (the preset before) breaks it on
    most of them. (On 400-job traces, where FIFO's longest wait is under 3 h, the due guard
    overshoots by up to 14 min: README.)"""
    runs = [(load_trace(ITP03), "20x8"), *synthetic_traces([1, 2, 3, 4], 3000, 0.875)]
    broken = 0
    for trace, cluster in runs:
        for policy in (POLICIES["gpucloud"], POLICIES["fsp"]):
            row = sweep_one(trace, cluster, policy, bound_slot=None, oracle=False)
            assert row.meets(jct=math.inf, max_wait=1.05, p99_wait=1.01), (policy.name, row)
        heuristic = sweep_one(trace, cluster, BACKLOG, bound_slot=None, oracle=False)
        broken += not heuristic.meets(jct=math.inf, max_wait=1.05, p99_wait=1.01)
    assert broken >= 3


def test_due_jobs_that_take_back_what_arrived_after_them_hold_where_protected_overruns_break() -> (
    None
):
    """ITP cluster08: with due jobs that protect a job once it started when due (`guard=
    "backfill"`), jobs that backfilled around a due job and overran their estimates keep it
    waiting (max wait 1.70 x FIFO's); under `fsp` and the `gpucloud` preset (`guard=
    "arrival"`) the due job takes their GPUs back."""
    trace = load_trace(ITP08)
    protected = POLICIES["fsp"].with_(guard="backfill", due_rebase=False, min_run=0.0)
    row = sweep_one(trace, "9x8", protected, bound_slot=None, oracle=False)
    assert row.max_wait_ratio > 1.5, row
    for policy in (POLICIES["gpucloud"], POLICIES["fsp"]):
        row = sweep_one(trace, "9x8", policy, bound_slot=None, oracle=False)
        assert row.meets(jct=math.inf, max_wait=1.05, p99_wait=1.01), (policy.name, row)
