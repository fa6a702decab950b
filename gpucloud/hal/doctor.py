"""`gpucloud doctor`: is this machine fit to train and serve? One line per check, each OK,
WARN or FAIL with what to do about it.

Checks read what the machine says about itself (torch, the vendor's tools, /proc, /dev/shm)
and run one real 2-process all-reduce. A check that does not apply to the backend in use
(topology on a CPU-only host) says so and passes.
"""

from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Callable

from gpucloud.errors import UserError
from gpucloud.hal import device as hal_device
from gpucloud.hal.check import FAIL, OK, WARN, Check
from gpucloud.hal.known_bad import known_bad_combinations
from gpucloud.hal.vendor_tools import nvidia_driver_version, tool

_LOW_FREE_FRACTION = 0.10
_MIN_SHM_BYTES = 1 << 30


def run_checks(allreduce_bytes: int | None = 16 << 20) -> list[Check]:
    """Every check, in order; `allreduce_bytes=None` skips the all-reduce (it starts two
    processes and takes a few seconds)."""
    checks, backend = _backend()
    steps: list[Callable[[hal_device.Backend], Check | list[Check]]] = [
        _versions,
        _devices,
        _topology,
        _memory,
        _shared_memory,
    ]
    if allreduce_bytes:
        steps.append(lambda b: _allreduce(b, allreduce_bytes))
    steps.append(known_bad_combinations)
    for step in steps:
        result = step(backend)
        checks += result if isinstance(result, list) else [result]
    return checks


def _backend() -> tuple[list[Check], hal_device.Backend]:
    available = ", ".join(hal_device.available())
    try:
        backend = hal_device.detect()
    except UserError as e:
        fix = "unset GPUCLOUD_DEVICE or set it to a backend available here"
        return [Check("backend", FAIL, str(e), fix)], hal_device.BACKENDS["cpu"]
    return [Check("backend", OK, f"{backend.name} (available here: {available})")], backend


def _versions(backend: hal_device.Backend) -> Check:
    import torch

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    if torch.version.cuda:
        parts.append(f"CUDA {torch.version.cuda}")
    if torch.version.hip:
        parts.append(f"ROCm {torch.version.hip}")
    if backend.name == "cuda":
        parts.append(f"cuDNN {torch.backends.cudnn.version()}")
        try:  # a build without NCCL (or with RCCL under another name) raises
            parts.append("NCCL " + ".".join(map(str, torch.cuda.nccl.version())))
        except (RuntimeError, AttributeError):
            parts.append("no NCCL")
    if backend.vendor_module:
        module = __import__(backend.vendor_module)
        parts.append(f"{backend.vendor_module} {getattr(module, '__version__', '?')}")
    if driver := nvidia_driver_version():
        parts.append(f"NVIDIA driver {driver}")
    return Check("versions", OK, ", ".join(parts))


def _devices(backend: hal_device.Backend) -> Check:
    if backend.name == "cpu":
        return Check("devices", OK, f"cpu only: {os.cpu_count()} cores, no accelerator visible")
    infos = hal_device.devices(backend)
    if not infos:
        return Check(
            "devices",
            FAIL,
            f"no {backend.name} device visible",
            f"check {backend.visible_devices_env} and the driver",
        )
    names = ", ".join(f"{i.index}: {i.name}" for i in infos)
    return Check("devices", OK, f"{len(infos)} {backend.name} device(s): {names}")


def _topology(backend: hal_device.Backend) -> Check:
    if backend.name == "cpu":
        return Check("topology", OK, "cpu backend: no device links to check")
    if backend.name != "cuda":
        return Check("topology", OK, f"no topology tool wired for {backend.name} yet")
    out = tool(["nvidia-smi", "topo", "-m"])
    if out is None:
        return Check(
            "topology",
            WARN,
            "nvidia-smi topo -m is not available",
            "install the NVIDIA driver utilities to see NVLink/PCIe links",
        )
    return topology_check(gpu_links(out))


def gpu_links(topo: str) -> dict[tuple[str, str], str]:
    """The link type of each GPU pair in `nvidia-smi topo -m` output (NV#, PIX, PXB, PHB,
    NODE or SYS), keyed by (row GPU, column GPU) with row < column."""
    lines = [line.split() for line in topo.splitlines() if line.strip()]
    header = next((cols for cols in lines if cols and cols[0].startswith("GPU")), [])
    gpus = [c for c in header if c.startswith("GPU")]
    links = {}
    for cols in lines:
        if cols and cols[0] in gpus and len(cols) > len(gpus):
            for j, link in enumerate(cols[1 : len(gpus) + 1]):
                if gpus.index(cols[0]) < j:
                    links[(cols[0], gpus[j])] = link
    return links


def topology_check(links: dict[tuple[str, str], str]) -> Check:
    if not links:
        return Check("topology", OK, "a single GPU: no links between devices")
    kinds: dict[str, int] = {}
    for link in links.values():
        kind = "NVLink" if link.startswith("NV") else link
        kinds[kind] = kinds.get(kind, 0) + 1
    detail = "GPU pairs by link: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
    across = [f"{a}-{b}" for (a, b), link in links.items() if link == "SYS"]
    if across:
        return Check(
            "topology",
            WARN,
            f"{detail}; across CPU sockets: {', '.join(across[:4])}",
            "keep a job's GPUs within one NUMA node, or expect slower all-reduce",
        )
    return Check("topology", OK, detail)


def _memory(backend: hal_device.Backend) -> list[Check]:
    infos = [hal_device.memory_info(0, hal_device.BACKENDS["cpu"])]
    if backend.name != "cpu":
        infos += hal_device.devices(backend)
    return [_memory_check(info) for info in infos]


def _memory_check(info: hal_device.DeviceInfo) -> Check:
    name = "memory host" if info.backend == "cpu" else f"memory {info.backend}:{info.index}"
    if info.total_bytes is None or info.free_bytes is None:
        return Check(name, OK, "the backend does not report memory")
    gib = 1 << 30
    detail = f"{info.free_bytes / gib:.1f} GiB free of {info.total_bytes / gib:.1f} GiB"
    measured = {"free_bytes": info.free_bytes, "total_bytes": info.total_bytes}
    if info.free_bytes < _LOW_FREE_FRACTION * info.total_bytes:
        fix = "find what holds the memory (nvidia-smi, top) first"
        return Check(name, WARN, detail, fix, measured)
    return Check(name, OK, detail, measured=measured)


def _shared_memory(backend: hal_device.Backend) -> Check:  # noqa: ARG001 - same on every backend
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError:
        return Check(
            "shared memory",
            WARN,
            "/dev/shm is missing",
            "mount a tmpfs on /dev/shm: data loaders and NCCL use it",
        )
    detail = f"/dev/shm {usage.free / (1 << 30):.1f} GiB free of {usage.total / (1 << 30):.1f} GiB"
    if usage.total < _MIN_SHM_BYTES:
        return Check(
            "shared memory",
            WARN,
            detail,
            "give containers more (docker run --shm-size=16g, or an emptyDir with "
            "medium: Memory on Kubernetes): data loaders and NCCL fail on 64 MiB",
        )
    return Check("shared memory", OK, detail)


def _allreduce(backend: hal_device.Backend, nbytes: int) -> Check:
    from gpucloud.hal.allreduce_probe import measure

    if backend.name != "cpu" and hal_device.device_count(backend) < 2:
        backend = hal_device.BACKENDS["cpu"]  # one device: test the host's gloo instead
    try:
        r = measure(backend.name, nbytes)
    except RuntimeError as e:
        return Check(
            "all-reduce",
            FAIL,
            f"2 processes over {backend.dist_backend}: {e}",
            "check the firewall between local processes and the collective "
            "library install; rerun with NCCL_DEBUG=INFO on GPUs",
        )
    detail = (
        f"2 processes over {r.dist_backend} on {r.device}: {r.nbytes / (1 << 20):.0f} MiB in "
        f"{r.seconds * 1000:.1f} ms, bus bandwidth {r.bus_bytes_per_s / 1e9:.2f} GB/s"
    )
    measured = {"bytes": r.nbytes, "seconds": r.seconds, "bus_bytes_per_s": r.bus_bytes_per_s}
    return Check("all-reduce", OK, detail, measured=measured)
