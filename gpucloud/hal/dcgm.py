"""Device telemetry as Prometheus metrics under the names and labels NVIDIA's dcgm-exporter
uses, so dashboards made for it (Grafana's "NVIDIA DCGM Exporter" one) work unchanged.

Labels: gpu (the index), UUID, device (its /dev node: nvidia0, davinci0 on Ascend), modelName
and Hostname (the node's name in gpucloud). Memory is in MiB, as DCGM reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily

from gpucloud.hal.telemetry import DeviceSample

LABELS = ["gpu", "UUID", "device", "modelName", "Hostname"]

# name, help, the figure of a sample (None: not reported, no series)
FIELDS: list[tuple[str, str, Callable[[DeviceSample], float | None]]] = [
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", lambda s: s.utilization),
    (
        "DCGM_FI_DEV_FB_USED",
        "Framebuffer memory used (in MiB).",
        lambda s: _mib(s.memory_used_bytes),
    ),
    (
        "DCGM_FI_DEV_FB_FREE",
        "Framebuffer memory free (in MiB).",
        lambda s: (
            _mib(s.memory_total_bytes - s.memory_used_bytes)
            if s.memory_total_bytes is not None and s.memory_used_bytes is not None
            else None
        ),
    ),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", lambda s: s.temperature_c),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", lambda s: s.power_w),
    (
        "DCGM_FI_DEV_XID_ERRORS",
        "Value of the last XID error encountered.",
        lambda s: s.xid_errors[-1] if s.xid_errors else 0,
    ),
    (
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "Total number of single-bit volatile ECC errors.",
        lambda s: s.ecc_corrected,
    ),
    (
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "Total number of double-bit volatile ECC errors.",
        lambda s: s.ecc_uncorrected,
    ),
]


def families(
    node: str, samples: list[DeviceSample], device_node: str = "nvidia"
) -> Iterator[GaugeMetricFamily]:
    """One family per DCGM field, a series per device that reports it; `device_node` is
    the /dev name of the source's devices without the index."""
    for name, doc, figure in FIELDS:
        family = GaugeMetricFamily(name, doc, labels=LABELS)
        for s in samples:
            value = figure(s)
            if value is not None:
                family.add_metric(_labels(node, s, device_node), value)
        yield family


def _labels(node: str, s: DeviceSample, device_node: str) -> list[str]:
    return [str(s.index), s.uuid, f"{device_node}{s.index}", s.name, node]


def _mib(n: int | None) -> float | None:
    return None if n is None else n / (1 << 20)
