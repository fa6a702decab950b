"""Ascend telemetry from `npu-smi info`: the table Huawei's tool prints, two rows per chip.

    | NPU  Name       | Health  | Power(W)  Temp(C)          Hugepages-Usage(page) |
    | Chip            | Bus-Id  | AICore(%) Memory-Usage(MB) HBM-Usage(MB)         |
    | 0    910B3      | OK      | 90.1      41               0    / 0              |
    | 0               | 0000:C1:00.0 | 12   0    / 0         3400 / 65536          |

(columns narrowed here). Training chips (910) report their HBM in a last column, inference
cards (310P) only the Memory-Usage one; power may read NA. npu-smi has no ECC or Xid
figures in this table.
"""

from __future__ import annotations

import re

from gpucloud.hal.telemetry import DeviceSample
from gpucloud.hal.vendor_tools import tool

_HEALTH = re.compile(r"^(OK|Warning|Alarm|Critical|NA|Unknown)$", re.IGNORECASE)
_BUS_ID = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d$")
_USED_TOTAL = re.compile(r"(\d+)\s*/\s*(\d+)")


class NpuSmiSource:
    name, device_node = "npu-smi", "davinci"

    def read(self) -> list[DeviceSample]:
        return parse_npu_smi(tool(["npu-smi", "info"]) or "")


def parse_npu_smi(text: str) -> list[DeviceSample]:
    """The chips `npu-smi info` lists, in its order (the processes table is skipped)."""
    rows = [_cells(line) for line in text.splitlines() if line.startswith("|")]
    samples = []
    for first, second in zip(rows, rows[1:], strict=False):
        if len(first) == 3 and len(second) == 3 and _is_chip(first, second):
            samples.append(_sample(first, second))
    return samples


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _is_chip(first: list[str], second: list[str]) -> bool:
    return (
        bool(re.match(r"^\d+\s+\S", first[0]))
        and bool(_HEALTH.match(first[1]))
        and bool(_BUS_ID.match(second[1]))
    )


def _sample(first: list[str], second: list[str]) -> DeviceSample:
    index, name = first[0].split(maxsplit=1)
    power, temp = (first[2].split() + ["NA", "NA"])[:2]
    usage = second[2].split(maxsplit=1)
    figures = usage[1] if len(usage) > 1 else ""
    pairs = [(int(u) << 20, int(t) << 20) for u, t in _USED_TOTAL.findall(figures)]
    hbm = [p for p in pairs[1:] if p[1] > 0]  # 910: the HBM column; 310P: none
    used, total = (hbm or pairs or [(None, None)])[-1]
    return DeviceSample(
        index=int(index),
        name=f"Ascend {name}",
        uuid=second[1],
        utilization=_number(usage[0] if usage else "NA"),
        memory_used_bytes=used,
        memory_total_bytes=total,
        temperature_c=_number(temp),
        power_w=_number(power),
        vendor_health=first[1],
    )


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None  # NA
