"""Which accelerator backend this process runs on, and what it can do.

Backends are found by name in one registry. Each declares how to detect itself, its
torch device type, its collective backend and the environment variable that pins devices
to a process. Nothing here imports torch at module import time, so the control plane
(which never imports torch) can read `BACKENDS` to pin devices for the processes it starts.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from functools import cache

from gpucloud.errors import UserError, unknown_name


@dataclass(frozen=True, slots=True)
class Backend:
    name: str  # cuda | npu | xpu | mps | cpu
    dist_backend: str  # torch.distributed backend for collectives
    visible_devices_env: str | None  # env var that pins devices to a process
    vendor_module: str | None = None  # extra import that registers the device with torch
    needs: str | None = None  # the software it needs, for the error when that is missing
    supports_bf16: bool = True
    supports_fsdp: bool = True
    supports_memory_query: bool = False  # reports total/free memory per device
    # torch.profiler.ProfilerActivity that records its kernels (None: host ops only)
    profiler_activity: str | None = None
    # env var that caps the share of a device's compute a process uses, in percent (NVIDIA
    # MPS), for processes that share one device
    compute_share_env: str | None = None


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in [
        Backend(
            "cuda",
            "nccl",
            "CUDA_VISIBLE_DEVICES",
            needs="a torch built with CUDA or ROCm",
            supports_memory_query=True,
            profiler_activity="CUDA",
            compute_share_env="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        ),
        Backend(
            "npu",
            "hccl",
            "ASCEND_RT_VISIBLE_DEVICES",
            vendor_module="torch_npu",
            needs="torch_npu (pip install torch-npu)",
            supports_memory_query=True,
        ),
        Backend(
            "xpu",
            "xccl",
            "ZE_AFFINITY_MASK",
            needs="a torch built with XPU",
            supports_memory_query=True,
            profiler_activity="XPU",
        ),
        Backend(
            "mps",
            "gloo",
            None,
            needs="a torch built with MPS, on macOS with Apple silicon",
            supports_fsdp=False,
        ),
        Backend("cpu", "gloo", None),
    ]
}

# Order of preference when several are present.
_DETECT_ORDER = ("cuda", "npu", "xpu", "mps")


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    backend: str
    index: int
    name: str
    total_bytes: int | None
    free_bytes: int | None


def prefer_passive_cpu_waits() -> None:
    """Ask OpenMP for passive waits unless the user chose a policy.

    Spinning OpenMP workers steal cores from each other and from the engine thread when a
    machine is shared: serving measured 3-6x slower at load 10 on 2 cores. Takes effect only
    if called before torch starts its thread pool (i.e. before `import torch`).
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _torch():
    import torch

    return torch


def _software_present(backend: Backend) -> bool:
    """Whether this torch (plus the vendor's extension, if any) knows the backend."""
    torch = _torch()
    if backend.vendor_module:
        try:
            importlib.import_module(backend.vendor_module)
        except ImportError:
            return False
        return True
    if backend.name == "cuda":
        return bool(torch.version.cuda or torch.version.hip)
    if backend.name == "xpu":
        return bool(getattr(torch.version, "xpu", None))
    if backend.name == "mps":
        return torch.backends.mps.is_built()
    return True


def _device_present(name: str) -> bool:
    torch = _torch()
    if name == "cpu":
        return True
    if name == "mps":
        return torch.backends.mps.is_available()
    module = getattr(torch, name, None)
    return bool(module) and module.is_available() and module.device_count() > 0


def _available(name: str) -> bool:
    return _software_present(BACKENDS[name]) and _device_present(name)


def available() -> list[str]:
    """The backends this process can use, in order of preference (cpu, always, last)."""
    return [name for name in _DETECT_ORDER if _available(name)] + ["cpu"]


@cache
def detect() -> Backend:
    """The backend this process uses: $GPUCLOUD_DEVICE if set, else the first one available.

    Raises UserError when $GPUCLOUD_DEVICE names an unknown backend or one this machine
    cannot run, saying what is missing and which backends are available.
    """
    forced = os.environ.get("GPUCLOUD_DEVICE")
    if forced:
        return _required(forced)
    for name in _DETECT_ORDER:
        if _available(name):
            return BACKENDS[name]
    return BACKENDS["cpu"]


def _required(name: str) -> Backend:
    if name not in BACKENDS:
        raise unknown_name("GPUCLOUD_DEVICE backend", name, BACKENDS)
    backend = BACKENDS[name]
    if not _software_present(backend):
        missing = backend.needs
        if not backend.vendor_module:
            missing += f" (installed: torch {_torch().__version__})"
    elif not _device_present(name):
        missing = f"a visible {name} device (torch finds none)"
    else:
        return backend
    raise UserError(
        f"GPUCLOUD_DEVICE={name} needs {missing}; backends available here: {', '.join(available())}"
    )


def get_backend(name: str) -> Backend:
    """Look a backend up by name; NotFoundError names the valid ones."""
    if name not in BACKENDS:
        raise unknown_name("device backend", name, BACKENDS)
    return BACKENDS[name]


def device_count(backend: Backend | None = None) -> int:
    backend = backend or detect()
    if backend.name == "cpu":
        return 1
    if backend.name == "mps":
        return 1
    return getattr(_torch(), backend.name).device_count()


def device(index: int = 0, backend: Backend | None = None):
    """A torch.device for the given local index on the backend."""
    backend = backend or detect()
    torch = _torch()
    if backend.name in ("cpu", "mps"):
        return torch.device(backend.name)
    return torch.device(backend.name, index)


def set_device(index: int, backend: Backend | None = None) -> None:
    """Bind this process to local device `index` (no-op where there is a single device),
    and cap its memory there at $GPUCLOUD_GPU_MEMORY_FRACTION where the backend can."""
    backend = backend or detect()
    if backend.name not in ("cpu", "mps"):
        module = getattr(_torch(), backend.name)
        module.set_device(index)
        share = memory_share()
        if share is not None and hasattr(module, "set_per_process_memory_fraction"):
            module.set_per_process_memory_fraction(share, index)


# The share of its device's memory a process may allocate, set by the control plane for a
# job given a share of one GPU that other jobs use too.
MEMORY_SHARE_ENV = "GPUCLOUD_GPU_MEMORY_FRACTION"


def memory_share() -> float | None:
    """$GPUCLOUD_GPU_MEMORY_FRACTION as a number in (0, 1], or None when unset."""
    value = os.environ.get(MEMORY_SHARE_ENV)
    if not value:
        return None
    try:
        share = float(value)
    except ValueError:
        share = 0.0
    if not 0 < share <= 1:
        raise UserError(f"{MEMORY_SHARE_ENV}={value}: give a number above 0 and at most 1")
    return share


def shared_device_env(share: float, backend_name: str) -> dict[str, str]:
    """Environment of a process given `share` (0 < share < 1) of one device that other
    processes use too: its memory cap (applied by set_device) and, where the backend has
    one, its compute share (NVIDIA MPS: a percentage of the device's SMs)."""
    env = {MEMORY_SHARE_ENV: f"{share:g}"}
    var = get_backend(backend_name).compute_share_env
    if var:
        env[var] = str(max(1, round(share * 100)))
    return env


def memory_info(index: int = 0, backend: Backend | None = None) -> DeviceInfo:
    """Total and free memory of one device, where the backend reports them (else None)."""
    backend = backend or detect()
    if backend.name == "cpu":
        total, free = _host_memory()
        return DeviceInfo("cpu", 0, "cpu", total, free)
    if not backend.supports_memory_query:
        return DeviceInfo(backend.name, index, backend.name, None, None)
    module = getattr(_torch(), backend.name)
    free, total = module.mem_get_info(index)
    return DeviceInfo(backend.name, index, module.get_device_name(index), total, free)


def devices(backend: Backend | None = None) -> list[DeviceInfo]:
    backend = backend or detect()
    return [memory_info(i, backend) for i in range(device_count(backend))]


def synchronize(backend: Backend | None = None) -> None:
    backend = backend or detect()
    if backend.name != "cpu":
        getattr(_torch(), backend.name).synchronize()


def visible_devices_env(indices: list[int], backend_name: str) -> dict[str, str]:
    """Environment that pins a child process to `indices` on `backend_name` (empty on cpu)."""
    var = get_backend(backend_name).visible_devices_env
    return {var: ",".join(str(i) for i in indices)} if var else {}


def _host_memory() -> tuple[int | None, int | None]:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        total, available = (int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "MemAvailable"))
        return total, available
    except (OSError, KeyError, ValueError):
        return None, None
