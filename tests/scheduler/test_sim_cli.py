"""`gpucloud sim` as a user runs it: the installed entry point, JSON out, reports, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

GPUCLOUD = str(Path(sys.executable).with_name("gpucloud"))
TIRESIAS = "/work/shared/traces/tiresias/60_job.csv"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([GPUCLOUD, "sim", *args], capture_output=True, text=True, timeout=300)


def test_run_json_has_the_documented_keys() -> None:
    done = _run("run", "--trace", TIRESIAS, "--cluster", "2x8", "--policy", "tiresias", "--json")
    assert done.returncode == 0, done.stderr
    s = json.loads(done.stdout)
    assert s["jobs"] == 60 and s["policy"] == "tiresias" and s["cluster"] == "2x8 A100-80GB"
    for key in ("avg_jct_s", "p95_jct_s", "avg_queue_s", "p95_queue_s", "max_wait_s",
                "makespan_s", "utilization", "preemptions", "jain_fairness"):  # fmt: skip
        assert isinstance(s[key], int | float), key
    assert 0 < s["utilization"] <= 1


def test_compare_writes_a_markdown_table_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "report"
    done = _run("compare", "--trace", TIRESIAS, "--cluster", "1x8", "--policies",
                "fifo,sjf,gpucloud", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    md = (out / "report.md").read_text()
    assert md.count("\n| ") == 4 and "| gpucloud |" in md and "JCT / fifo" in md
    for png in ("jct_cdf.png", "queue.png", "utilization.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert "wrote" in done.stdout and "gpucloud" in done.stdout


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("job_id,num_gpu,submit_time,duration\n1,2,0,-5\n")
    for args, msg in (
        (["--trace", str(bad), "--cluster", "1x8", "--policy", "fifo"], "row 2: duration -5"),
        (["--trace", TIRESIAS, "--cluster", "1x8", "--policy", "fifoo"], "did you mean fifo"),
        (["--trace", TIRESIAS, "--cluster", "1x8", "--policy", "fifo", "--vc", "x"],
         "selects a Philly virtual cluster"),
        (["--trace", TIRESIAS, "--cluster", "8", "--policy", "fifo"], "write NODESxGPUS"),
    ):  # fmt: skip
        done = _run("run", *args)
        assert done.returncode == 2, done.stderr
        assert msg in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
