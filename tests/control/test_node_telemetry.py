"""Device telemetry and `gpucloud doctor --job` through a real control plane, one server
for the module (SQLite only: telemetry → node health → failover is under test, not the
store): `gpucloud server --telemetry recorded:FILE` exports the node's devices on /metrics
under dcgm-exporter's names, and a fatal device error in the recording takes the node
down with the reason and requeues its job, which runs again once the device is healthy;
an interactive job whose GPU reports no use is stopped after the cluster's idle TTL."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpucloud.hal.telemetry import DeviceSample, snapshot_json

from .conftest import GPUCLOUD, Server, wait_for, wait_state, workload_pids

GPU0 = DeviceSample(0, "NVIDIA H100 80GB HBM3", "GPU-aaaa", utilization=87.0,
                    memory_used_bytes=40 << 30, memory_total_bytes=80 << 30, temperature_c=61.0,
                    power_w=402.5, ecc_corrected=0, ecc_uncorrected=0)  # fmt: skip
GPU1 = replace(GPU0, index=1, uuid="GPU-bbbb", utilization=12.0)


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    path = tmp_path_factory.mktemp("telemetry") / "telemetry.jsonl"
    path.write_text(snapshot_json([GPU0, GPU1]) + "\n")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, recording):
    home = tmp_path_factory.mktemp("home")
    srv = Server(f"sqlite:///{home / 'state.db'}", home, gpus=2,
                 extra=("--telemetry", f"recorded:{recording}",
                        "--idle-ttl", "2s")).start()  # fmt: skip
    yield srv
    srv.stop()


def _record(path, *devices: DeviceSample) -> None:
    with path.open("a") as f:
        f.write(snapshot_json(list(devices)) + "\n")


def _dcgm(server: Server) -> dict[tuple[str, str], tuple[dict, float]]:
    text = httpx.get(server.url + "/metrics").text
    return {
        (s.name, s.labels["gpu"]): (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("DCGM_")
    }


def test_doctor_names_a_jobs_bottlenecks_from_its_metrics_and_log(server):
    key = server.client().post("/tenants", {"name": "doctor"})["api_key"]
    team = server.client(key)
    records = [{"step": s, "step_time_s": 0.5, "tokens_per_s": 65536.0, "data_time_s": 0.3,
                "sync_time_s": 0.0} for s in (1, 2, 3)] + [
               {"step": 3, "event": "skip", "reason": "nan"}]  # fmt: skip
    lines = "\n".join(json.dumps(r) for r in records)
    command = (f"printf '%s\\n' '{lines}' > $GPUCLOUD_CHECKPOINT_DIR/metrics.jsonl; "
               "echo 'RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB'")  # fmt: skip
    job = team.post("/jobs", {"name": "slow", "command": command, "checkpoint_dir": "doc",
                              "max_retries": 0})["id"]  # fmt: skip
    wait_state(team, job, "SUCCEEDED")
    env = {**server.env, "GPUCLOUD_API_KEY": key}
    out = subprocess.run([GPUCLOUD, "doctor", "--job", str(job), "--json"], env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    found = {c["name"]: c for c in json.loads(out.stdout)}
    assert set(found) == {"input pipeline stall", "NaN/overflow history", "out of memory"}
    assert found["input pipeline stall"]["detail"].startswith("reading batches took 60%")
    assert found["NaN/overflow history"]["detail"] == "nan at step(s) 3"
    assert "CUDA out of memory" in found["out of memory"]["detail"]
    bare = team.post("/jobs", {"name": "bare", "command": "true"})["id"]
    missing = subprocess.run([GPUCLOUD, "doctor", "--job", str(bare)], env=env,
                             capture_output=True, text=True)  # fmt: skip
    assert missing.returncode == 2
    assert f"job {bare} keeps no metrics: a command job needs a checkpoint_dir" in missing.stderr


def test_a_fatal_xid_takes_the_node_down_and_requeues_its_job(server, recording):
    try:
        team = server.tenant("telemetry")
        job = team.post("/jobs", {"name": "long", "gpus": 2, "command": "sleep 300"})["id"]
        wait_state(team, job, "RUNNING")
        node = server.client().get("/nodes")[0]["name"]
        series = _dcgm(server)
        assert series["DCGM_FI_DEV_GPU_UTIL", "1"] == (
            {"gpu": "1", "UUID": "GPU-bbbb", "device": "nvidia1",
             "modelName": "NVIDIA H100 80GB HBM3", "Hostname": node}, 12.0,
        )  # fmt: skip
        assert series["DCGM_FI_DEV_FB_USED", "0"][1] == 40960  # MiB
        assert series["DCGM_FI_DEV_XID_ERRORS", "1"][1] == 0

        _record(recording, GPU0, replace(GPU1, xid_errors=(79,)))
        reason = "gpu 1: Xid 79 (GPU has fallen off the bus)"
        down = wait_for(lambda: (n := server.client().get("/nodes")[0])["state"] == "down" and n)
        assert down["reason"] == reason
        requeued = wait_state(team, job, "RETRYING", "PENDING")
        assert requeued["reason"].startswith(f"node {node} is down ({reason}); requeued")
        assert requeued["requeues"] == 1
        assert not workload_pids(server.home, f"job-{job}")  # its processes were stopped
        assert _dcgm(server)["DCGM_FI_DEV_XID_ERRORS", "1"][1] == 79

        _record(recording, GPU0, GPU1)  # the GPU was reset: the node takes work again
        wait_for(lambda: server.client().get("/nodes")[0]["state"] == "ready")
        again = wait_state(team, job, "RUNNING")
        assert again["attempts"] == 2 and again["requeues"] == 1
    finally:
        _record(recording, GPU0, GPU1)
    team.post(f"/jobs/{job}/cancel", {})
    wait_state(team, job, "CANCELLED")


def test_an_interactive_job_on_an_unused_gpu_is_stopped_though_it_prints(server, recording):
    try:
        _record(recording, replace(GPU0, utilization=0.0), replace(GPU1, utilization=3.0))
        team = server.tenant("notebooks")
        # it writes to its log all along: telemetry, where there is some, is what counts
        command = "while true; do echo tick; sleep 0.2; done"
        job = team.post("/jobs", {"name": "nb", "command": command, "interactive": True})
        assert job["idle_ttl"] is None  # the cluster's (gpucloud server --idle-ttl 2s)
        stopped = wait_state(team, job["id"], "CANCELLED")
        assert stopped["reason"].startswith("idle for 2")
        assert stopped["reason"].endswith("(its accelerators' utilisation at most 5%): stopped")
        assert not workload_pids(server.home, f"job-{job['id']}")
    finally:
        _record(recording, GPU0, GPU1)
