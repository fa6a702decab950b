"""`gpucloud doctor` on this machine, run as a user runs it, plus its parsers on recorded
vendor-tool output."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpucloud.cli.main import _app
from gpucloud.errors import UserError
from gpucloud.hal.allreduce_probe import measure
from gpucloud.hal.doctor import gpu_links, topology_check

GPUCLOUD = str(Path(sys.executable).with_name("gpucloud"))

# `nvidia-smi topo -m` of a 4-GPU, 2-socket machine: NVLink pairs within a socket.
TOPO = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV4\tSYS\tSYS\t0-15\t0
GPU1\tNV4\t X \tSYS\tSYS\t0-15\t0
GPU2\tSYS\tSYS\t X \tNV4\t16-31\t1
GPU3\tSYS\tSYS\tNV4\t X \t16-31\t1

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes
"""


def _doctor(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([GPUCLOUD, "doctor", *args], capture_output=True, text=True,
                          timeout=180, env=os.environ | env)  # fmt: skip


def test_doctor_checks_this_machine_and_flags_bad_settings():
    done = _doctor("--json", NCCL_P2P_DISABLE="1", OMP_NUM_THREADS="4096")
    assert done.returncode == 0, done.stderr  # warnings only
    checks = json.loads(done.stdout)
    names = [c["name"] for c in checks]
    assert names[:7] == ["backend", "versions", "devices", "topology", "memory host",
                         "shared memory", "all-reduce"]  # fmt: skip
    by_name = {c["name"]: c for c in checks}
    assert by_name["backend"]["status"] == "OK" and "cpu" in by_name["backend"]["detail"]
    assert "torch 2." in by_name["versions"]["detail"]
    allreduce = by_name["all-reduce"]
    assert allreduce["status"] == "OK" and "over gloo" in allreduce["detail"]
    assert allreduce["measured"]["bus_bytes_per_s"] > 0
    assert allreduce["measured"]["bytes"] == 16 << 20
    memory = by_name["memory host"]["measured"]
    assert 0 < memory["free_bytes"] <= memory["total_bytes"]
    warnings = [c for c in checks if c["name"] == "known-bad"]
    assert [c["status"] for c in warnings] == ["WARN", "WARN"]
    assert "NCCL_P2P_DISABLE=1" in warnings[0]["detail"] and warnings[0]["fix"]
    assert "OMP_NUM_THREADS=4096" in warnings[1]["detail"]


def test_an_unusable_backend_fails_with_the_fix_and_exit_1():
    done = _doctor("--allreduce-mib", "0", GPUCLOUD_DEVICE="cuda")
    assert done.returncode == 1
    assert "FAIL" in done.stdout and "GPUCLOUD_DEVICE=cuda needs" in done.stdout
    assert "unset GPUCLOUD_DEVICE" in done.stdout and "all-reduce" not in done.stdout


def test_a_failing_all_reduce_reports_the_ranks_error():
    with pytest.raises(RuntimeError, match="rank 0: .*MPS"):  # no MPS here: every rank fails
        measure("mps", nbytes=1024)


def test_topology_warns_about_gpus_across_sockets():
    links = gpu_links(TOPO)
    assert links[("GPU0", "GPU1")] == "NV4" and links[("GPU1", "GPU2")] == "SYS"
    assert len(links) == 6
    check = topology_check(links)
    assert check.status == "WARN" and "NVLink 2, SYS 4" in check.detail
    assert "GPU0-GPU2" in check.detail and "NUMA" in check.fix
    nvlink_only = {pair: "NV12" for pair in links}
    assert topology_check(nvlink_only).status == "OK"


def test_negative_allreduce_size_is_a_user_error():
    done = CliRunner().invoke(_app, ["doctor", "--allreduce-mib", "-1"])
    assert isinstance(done.exception, UserError) and "--allreduce-mib" in str(done.exception)
