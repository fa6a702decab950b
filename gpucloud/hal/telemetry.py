"""GPU telemetry behind one interface: what each device of this machine says about itself
(utilisation, memory, temperature, power, ECC and Xid errors), from one of these sources:

- `nvml`: NVIDIA's management library through `nvidia-ml-py` (`pip install nvidia-ml-py`;
  imported only when chosen), see telemetry_nvml.py;
- `npu-smi`: the table Huawei's `npu-smi info` prints on Ascend machines, see telemetry_npu.py;
- `recorded:PATH`: the last line of a JSON-lines file of snapshots, each as
  `gpucloud hal telemetry --json` prints it (for tests, demos and replaying an incident);
- `auto`: NVML when the library loads and sees a GPU, else npu-smi when installed, else none.

This module never imports torch: the control plane reads it for its node's health and its
/metrics. Units are bytes, watts, degrees Celsius and percent.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Protocol

from gpucloud.errors import ConfigError, GpucloudError
from gpucloud.hal.gpu_health import fatal_errors

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DeviceSample:
    """One device at one moment; None where its source does not report a figure."""

    index: int
    name: str
    uuid: str  # NVML's UUID; the PCI bus id where the vendor's tool gives no UUID
    utilization: float | None = None  # percent of time the device was busy
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_corrected: int | None = None  # volatile counts: since the driver loaded
    ecc_uncorrected: int | None = None
    # Xid codes the driver reported for this device since its source opened, oldest first
    xid_errors: tuple[int, ...] = ()
    vendor_health: str | None = None  # the vendor tool's own verdict (npu-smi: OK, Critical...)

    @classmethod
    def from_json(cls, d: dict) -> DeviceSample:
        unknown = set(d) - set(cls.__slots__)
        if unknown:
            raise ConfigError(f"unknown telemetry field(s) {sorted(unknown)}: use {cls.__slots__}")
        return cls(**{**d, "xid_errors": tuple(d.get("xid_errors", ()))})


class Source(Protocol):
    name: str
    device_node: str  # the /dev name of its devices, less the index: nvidia, davinci

    def read(self) -> list[DeviceSample]:
        """Every device visible now (a device that fell off the bus is missing)."""
        ...


class RecordedSource:
    """Snapshots written by someone else: each read returns the file's last line, so a test
    (or `gpucloud hal telemetry --json >> FILE`) appends a line to change what is seen."""

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise ConfigError(f"telemetry recording {path} does not exist: give a JSON-lines file")
        self.path, self.name, self.device_node = path, f"recorded:{path}", "nvidia"

    def read(self) -> list[DeviceSample]:
        lines = [line for line in self.path.read_text().splitlines() if line.strip()]
        if not lines:
            return []
        try:
            snapshot = json.loads(lines[-1])
            return [DeviceSample.from_json(d) for d in snapshot["devices"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{self.path}: last line is not a telemetry snapshot: {e}") from e


class NoSource:
    name, device_node = "none", "nvidia"

    def read(self) -> list[DeviceSample]:
        return []


SPECS = ("auto", "none", "nvml", "npu-smi", "recorded:PATH")


def open_source(spec: str) -> Source:
    """The source `spec` names (one of SPECS). Raises ConfigError for an unknown spec, a
    missing recording, or a vendor source that cannot run here."""
    if spec.startswith("recorded:"):
        return RecordedSource(Path(spec.removeprefix("recorded:")))
    if spec == "none":
        return NoSource()
    if spec == "nvml":
        return _nvml(required=True)
    if spec == "npu-smi":
        if not shutil.which("npu-smi"):
            raise ConfigError("telemetry source npu-smi: the npu-smi command is not installed")
        from gpucloud.hal.telemetry_npu import NpuSmiSource

        return NpuSmiSource()
    if spec == "auto":
        if (nvml := _nvml(required=False)) is not None:
            return nvml
        return open_source("npu-smi") if shutil.which("npu-smi") else NoSource()
    raise ConfigError(f"unknown telemetry source {spec!r}: use one of {', '.join(SPECS)}")


def _nvml(required: bool) -> Source | None:
    if find_spec("pynvml") is None:
        if required:
            raise ConfigError("telemetry source nvml needs nvidia-ml-py: pip install nvidia-ml-py")
        return None
    from gpucloud.hal.telemetry_nvml import NvmlSource, NvmlUnavailable

    try:
        return NvmlSource()
    except NvmlUnavailable as e:
        if required:
            raise ConfigError(f"telemetry source nvml: {e}") from e
        return None


def snapshot_json(samples: list[DeviceSample], now: float | None = None) -> str:
    """One line of a recording: `{"time": ..., "devices": [...]}`."""
    devices = [asdict(s) for s in samples]
    return json.dumps({"time": time.time() if now is None else now, "devices": devices})


@dataclass(slots=True)
class Monitor:
    """A source read at most every `interval` seconds, with the devices it first saw (the
    baseline a device that disappears is missed from)."""

    source: Source
    interval: float = 2.0
    samples: list[DeviceSample] = field(default_factory=list)
    baseline: dict[int, str] | None = None  # index -> uuid of the first non-empty read
    read_at: float = float("-inf")
    # the reconciler's thread and /metrics scrapes read it: one read at a time
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def latest(self) -> list[DeviceSample]:
        with self.lock:
            return self._latest()

    def _latest(self) -> list[DeviceSample]:
        now = time.monotonic()
        if now - self.read_at >= self.interval:
            self.read_at = now
            try:
                self.samples = self.source.read()
            except (GpucloudError, OSError) as e:  # a bad read says nothing of the devices
                log.warning("telemetry from %s not read: %s", self.source.name, e)
                return self.samples
            if self.baseline is None and self.samples:
                self.baseline = {s.index: s.uuid for s in self.samples}
        return self.samples

    def fatal(self) -> list[str]:
        """What makes this machine unfit for work now (empty when healthy)."""
        samples = self.latest()
        return fatal_errors(self.baseline or {}, samples)
