"""Device telemetry: the npu-smi parser on recorded output, the recorded source, the health
rules, the DCGM-named export and `gpucloud hal telemetry`; NVML when a GPU is here."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from importlib.util import find_spec
from pathlib import Path

import pytest
from cli_run import run_cli
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpucloud.errors import ConfigError
from gpucloud.hal import dcgm
from gpucloud.hal.gpu_health import fatal_errors
from gpucloud.hal.telemetry import DeviceSample, Monitor, RecordedSource, open_source, snapshot_json
from gpucloud.hal.telemetry_npu import parse_npu_smi

DATA = Path(__file__).parent / "data"
GPU0 = DeviceSample(0, "NVIDIA H100 80GB HBM3", "GPU-aaaa", utilization=87.0,
                    memory_used_bytes=40 << 30, memory_total_bytes=80 << 30, temperature_c=61.0,
                    power_w=402.5, ecc_corrected=3, ecc_uncorrected=0)  # fmt: skip
GPU1 = replace(GPU0, index=1, uuid="GPU-bbbb", utilization=12.0)


def test_npu_smi_tables_of_training_and_inference_chips_parse():
    chips = parse_npu_smi((DATA / "npu_smi_910b.txt").read_text())
    assert [(c.index, c.name, c.uuid, c.vendor_health) for c in chips] == [
        (0, "Ascend 910B3", "0000:C1:00.0", "OK"),
        (1, "Ascend 910B3", "0000:C2:00.0", "Critical"),
    ]  # the processes table below is not taken for chips
    assert (chips[0].utilization, chips[0].power_w, chips[0].temperature_c) == (37, 96.4, 42)
    assert (chips[0].memory_used_bytes, chips[0].memory_total_bytes) == (41230 << 20, 65536 << 20)
    (card,) = parse_npu_smi((DATA / "npu_smi_310p.txt").read_text())
    assert (card.index, card.power_w, card.utilization) == (3, None, 5)  # power NA
    assert (card.memory_used_bytes, card.memory_total_bytes) == (1840 << 20, 21527 << 20)
    assert fatal_errors({0: "a", 1: "b"}, chips) == [
        "gpu 1: the vendor tool reports health Critical"
    ]
    assert parse_npu_smi("") == []


def test_fatal_errors_name_the_device_and_the_cause():
    base = {0: "GPU-aaaa", 1: "GPU-bbbb"}
    assert fatal_errors(base, [GPU0, GPU1]) == []
    app_fault = replace(GPU1, xid_errors=(13, 31, 94))  # the process's fault, not the GPU's
    assert fatal_errors(base, [GPU0, app_fault]) == []
    sick = replace(GPU1, xid_errors=(13, 79, 79), ecc_uncorrected=2)
    assert fatal_errors(base, [GPU0, sick]) == [
        "gpu 1: Xid 79 (GPU has fallen off the bus)",
        "gpu 1: 2 uncorrectable ECC error(s)",
    ]
    assert fatal_errors(base, [GPU0]) == ["gpu 1 (GPU-bbbb) is no longer visible"]
    assert fatal_errors(base, [GPU0, replace(GPU1, xid_errors=(48,))]) == [
        "gpu 1: Xid 48 (double-bit ECC error)"
    ]


def test_a_recording_is_read_at_its_last_line_and_a_lost_device_is_missed(tmp_path):
    path = tmp_path / "rec.jsonl"
    path.write_text(snapshot_json([GPU0, GPU1], now=1.0) + "\n")
    monitor = Monitor(open_source(f"recorded:{path}"), interval=0)
    assert monitor.latest() == [GPU0, GPU1] and monitor.fatal() == []
    with path.open("a") as f:
        f.write(snapshot_json([GPU0], now=2.0) + "\n")
    assert monitor.fatal() == ["gpu 1 (GPU-bbbb) is no longer visible"]
    with path.open("a") as f:
        f.write("{not json\n")
    assert monitor.latest() == [GPU0]  # a bad line changes nothing (and is logged)
    with pytest.raises(ConfigError, match="not a telemetry snapshot"):
        RecordedSource(path).read()
    path.write_text(json.dumps({"devices": [{"index": 0, "name": "x", "uuid": "u", "fan": 1}]}))
    with pytest.raises(ConfigError, match=r"unknown telemetry field\(s\) \['fan'\]"):
        RecordedSource(path).read()


def test_sources_refuse_what_cannot_work_here(tmp_path):
    with pytest.raises(ConfigError, match="unknown telemetry source 'dcgm': use one of auto"):
        open_source("dcgm")
    with pytest.raises(ConfigError, match="does not exist"):
        open_source(f"recorded:{tmp_path / 'missing.jsonl'}")
    if find_spec("pynvml") is None:
        with pytest.raises(ConfigError, match="pip install nvidia-ml-py"):
            open_source("nvml")
    if shutil.which("npu-smi") is None:
        with pytest.raises(ConfigError, match="npu-smi command is not installed"):
            open_source("npu-smi")
    if find_spec("pynvml") is None and shutil.which("npu-smi") is None:
        assert open_source("auto").read() == []


def test_dcgm_exporter_names_and_labels():
    registry = CollectorRegistry()

    class Devices:
        def collect(self):
            return dcgm.families("node-a", [GPU0, replace(GPU1, xid_errors=(79,))])

    registry.register(Devices())
    series = {
        (sample.name, sample.labels["gpu"]): (sample.labels, sample.value)
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }
    labels = {"gpu": "1", "UUID": "GPU-bbbb", "device": "nvidia1",
              "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "node-a"}  # fmt: skip
    for name, value in {
        "DCGM_FI_DEV_GPU_UTIL": 12.0,
        "DCGM_FI_DEV_FB_USED": 40960.0,  # MiB, as DCGM
        "DCGM_FI_DEV_FB_FREE": 40960.0,
        "DCGM_FI_DEV_GPU_TEMP": 61.0,
        "DCGM_FI_DEV_POWER_USAGE": 402.5,
        "DCGM_FI_DEV_XID_ERRORS": 79.0,
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": 3.0,
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 0.0,
    }.items():
        assert series[name, "1"] == (labels, value), name
    assert series["DCGM_FI_DEV_XID_ERRORS", "0"][1] == 0  # no Xid yet


def test_the_cli_shows_a_recording_and_prints_the_next_line_of_one(capsys, monkeypatch, tmp_path):
    path = tmp_path / "rec.jsonl"
    path.write_text(snapshot_json([GPU0, replace(GPU1, xid_errors=(79,))]) + "\n")
    shown = run_cli(capsys, monkeypatch, "hal", "telemetry", "--source", f"recorded:{path}")
    assert shown.returncode == 0, shown.stderr
    assert "NVIDIA H100 80GB HBM3" in shown.stdout and "402 W" in shown.stdout
    assert "FATAL gpu 1: Xid 79 (GPU has fallen off the bus)" in shown.stdout
    line = run_cli(capsys, monkeypatch, "hal", "telemetry", "--source", f"recorded:{path}",
                   "--json")  # fmt: skip
    snapshot = json.loads(line.stdout)
    assert snapshot["fatal"] == ["gpu 1: Xid 79 (GPU has fallen off the bus)"]
    path.write_text(line.stdout)  # the JSON line is itself a recording
    assert RecordedSource(path).read() == [GPU0, replace(GPU1, xid_errors=(79,))]
    bad = run_cli(capsys, monkeypatch, "hal", "telemetry", "--source", "nvml3")
    assert bad.returncode == 2 and "unknown telemetry source 'nvml3'" in bad.stderr


@pytest.mark.skipif(
    find_spec("pynvml") is None or shutil.which("nvidia-smi") is None,
    reason="needs an NVIDIA GPU and nvidia-ml-py",
)
def test_nvml_reads_every_gpu_of_this_machine():
    samples = open_source("nvml").read()
    assert samples and all(s.uuid.startswith("GPU-") for s in samples)
    assert all(s.memory_total_bytes and s.memory_total_bytes > 0 for s in samples)
