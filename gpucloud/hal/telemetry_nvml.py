"""NVIDIA telemetry through NVML (`pip install nvidia-ml-py`, imported as pynvml).

Figures are read per device on each call. Xid errors come as NVML events: the source
registers every device for critical Xid events when it opens and drains the queue on each
read, keeping each device's codes for the life of the source (as the driver keeps its
volatile ECC counts until it is reloaded). A device that fell off the bus answers
GPU_IS_LOST and is left out of the read, so it is missed from the baseline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pynvml

from gpucloud.hal.telemetry import DeviceSample


class NvmlUnavailable(Exception):
    """NVML cannot be used here: no driver, or no GPU."""


class NvmlSource:
    name, device_node = "nvml", "nvidia"

    def __init__(self) -> None:
        try:
            pynvml.nvmlInit()
            self.count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as e:
            raise NvmlUnavailable(str(e)) from e
        if self.count == 0:
            raise NvmlUnavailable("NVML sees no GPU")
        self.xids: dict[int, list[int]] = {i: [] for i in range(self.count)}
        self.events = pynvml.nvmlEventSetCreate()
        for i in range(self.count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                pynvml.nvmlDeviceRegisterEvents(
                    handle, pynvml.nvmlEventTypeXidCriticalError, self.events
                )
            except pynvml.NVMLError:  # not supported, or already lost: read() says which
                continue

    def read(self) -> list[DeviceSample]:
        self._drain_xids()
        samples = []
        for i in range(self.count):
            try:
                samples.append(self._sample(i))
            except pynvml.NVMLError_GpuIsLost:
                continue
        return samples

    def _sample(self, i: int) -> DeviceSample:
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        memory = _optional(lambda: pynvml.nvmlDeviceGetMemoryInfo(h))
        power_mw = _optional(lambda: pynvml.nvmlDeviceGetPowerUsage(h))
        utilization = _optional(lambda: pynvml.nvmlDeviceGetUtilizationRates(h))
        return DeviceSample(
            index=i,
            name=_text(pynvml.nvmlDeviceGetName(h)),
            uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
            utilization=utilization.gpu if utilization is not None else None,
            memory_used_bytes=memory.used if memory is not None else None,
            memory_total_bytes=memory.total if memory is not None else None,
            temperature_c=_optional(
                lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
            ),
            power_w=power_mw / 1000 if power_mw is not None else None,
            ecc_corrected=_ecc(h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ecc_uncorrected=_ecc(h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
            xid_errors=tuple(self.xids[i]),
        )

    def _drain_xids(self) -> None:
        wait = getattr(pynvml, "nvmlEventSetWait_v2", pynvml.nvmlEventSetWait)
        while True:
            try:
                event = wait(self.events, 0)
            except pynvml.NVMLError:  # Timeout: the queue is empty
                return
            index = _optional(lambda e=event: pynvml.nvmlDeviceGetIndex(e.device))
            if index in self.xids:
                self.xids[index].append(int(event.eventData))


def _ecc(handle: Any, kind: int) -> int | None:
    return _optional(
        lambda: pynvml.nvmlDeviceGetTotalEccErrors(handle, kind, pynvml.NVML_VOLATILE_ECC)
    )


def _optional(read: Callable[[], Any]) -> Any:
    """The figure, or None where the device does not support it (ECC off, no power sensor);
    a lost GPU still raises."""
    try:
        return read()
    except pynvml.NVMLError_GpuIsLost:
        raise
    except pynvml.NVMLError:
        return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # older pynvml: bytes
