"""Which device errors make a machine unfit for work: the rules that turn telemetry into a
node's health.

A fatal error is one that the device does not recover from while it runs: the driver's
Xid codes that call for a GPU reset or a reboot, any uncorrectable (double-bit) ECC error,
a vendor tool's Critical verdict, or a device that is no longer visible. Application
faults (an illegal address, Xid 13/31/43) end one process, not the machine, and are not
fatal here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpucloud.hal.telemetry import DeviceSample

# NVIDIA's Xid catalog: the codes that need the GPU reset (or the machine rebooted)
FATAL_XIDS = {
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping event (reset to apply it)",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}

# Codes that end the process that caused them; the device stays usable
APPLICATION_XIDS = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup",
    94: "contained ECC error",
}

FATAL_VENDOR_HEALTH = ("Critical",)


def describe_xid(code: int) -> str:
    """'Xid 79 (GPU has fallen off the bus)'; an unlisted code is named by its number."""
    meaning = FATAL_XIDS.get(code) or APPLICATION_XIDS.get(code)
    return f"Xid {code}" + (f" ({meaning})" if meaning else "")


def fatal_errors(baseline: dict[int, str], samples: list[DeviceSample]) -> list[str]:
    """One reason per fatal condition, device by device: `baseline` maps the index of each
    device first seen to its uuid, so a device missing from `samples` is named."""
    reasons = []
    seen = {s.index for s in samples}
    for index, uuid in sorted(baseline.items()):
        if index not in seen:
            reasons.append(f"gpu {index} ({uuid}) is no longer visible")
    for s in samples:
        fatal_xids = [x for x in dict.fromkeys(s.xid_errors) if x in FATAL_XIDS]
        reasons += [f"gpu {s.index}: {describe_xid(x)}" for x in fatal_xids]
        if s.ecc_uncorrected:
            reasons.append(f"gpu {s.index}: {s.ecc_uncorrected} uncorrectable ECC error(s)")
        if s.vendor_health in FATAL_VENDOR_HEALTH:
            reasons.append(f"gpu {s.index}: the vendor tool reports health {s.vendor_health}")
    return reasons
