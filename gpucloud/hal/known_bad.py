"""Combinations of software, settings and hardware known to break or slow training.

Each rule looks at the machine and returns a finding, or None when it does not apply. A new
rule is one function added to RULES.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpucloud.hal.check import FAIL, OK, WARN, Check
from gpucloud.hal.vendor_tools import nvidia_driver_version

if TYPE_CHECKING:
    from gpucloud.hal.device import Backend


def _slow_nccl_settings(backend: Backend) -> Check | None:

    names = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE")
    found = [f"{n}={os.environ[n]}" for n in names if os.environ.get(n, "0") not in ("", "0")]
    if not found:
        return None
    return Check(
        "known-bad",
        WARN,
        f"{', '.join(found)} turns off fast transports",
        "unset it unless a vendor asked for it: all-reduce falls back to "
        "slower paths (sockets, host copies)",
    )


def _omp_oversubscribed(backend: Backend) -> Check | None:

    value, cores = os.environ.get("OMP_NUM_THREADS", ""), os.cpu_count() or 1
    if not value.isdigit() or int(value) <= cores:
        return None
    return Check(
        "known-bad",
        WARN,
        f"OMP_NUM_THREADS={value} but the machine has {cores} cores",
        f"set OMP_NUM_THREADS to at most {cores} divided by the processes per node: "
        "spinning threads that share cores run several times slower",
    )


def _cuda_torch_without_usable_gpu(backend: Backend) -> Check | None:
    """nvidia-smi sees GPUs but torch cannot use them: most often a driver older than the
    CUDA that torch was built with, or CUDA_VISIBLE_DEVICES hiding every GPU."""
    import torch

    driver = nvidia_driver_version()
    if backend.name == "cuda" or not driver:
        return None
    if not torch.version.cuda:
        return Check(
            "known-bad",
            FAIL,
            f"NVIDIA driver {driver} but torch {torch.__version__} is a CPU-only build",
            "install a CUDA build of torch",
        )
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return Check(
            "known-bad",
            FAIL,
            f"CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU",
            "unset CUDA_VISIBLE_DEVICES or list the GPUs to use",
        )
    return Check(
        "known-bad",
        FAIL,
        f"torch built for CUDA {torch.version.cuda} cannot use the GPUs with driver {driver}",
        "upgrade the NVIDIA driver to one that supports this CUDA, or install a torch "
        "built for an older CUDA",
    )


def _cuda_without_bf16(backend: Backend) -> Check | None:
    import torch

    if backend.name != "cuda" or torch.cuda.is_bf16_supported():
        return None
    name = torch.cuda.get_device_name(0)
    return Check(
        "known-bad",
        WARN,
        f"{name} has no native bfloat16",
        "train and serve with dtype float16 (with loss scaling) on this GPU",
    )


def _torch_npu_mismatch(backend: Backend) -> Check | None:
    import torch

    if backend.name != "npu":
        return None
    import torch_npu

    npu, base = torch_npu.__version__, torch.__version__
    if npu.split(".")[:2] == base.split(".")[:2]:
        return None
    return Check(
        "known-bad",
        FAIL,
        f"torch_npu {npu} is built for another torch than {base}",
        "install the torch_npu release whose version matches torch's",
    )


RULES: list[Callable[[Backend], Check | None]] = [
    _slow_nccl_settings,
    _omp_oversubscribed,
    _cuda_torch_without_usable_gpu,
    _cuda_without_bf16,
    _torch_npu_mismatch,
]


def known_bad_combinations(backend: Backend) -> list[Check]:
    """The findings of every rule; one OK line when none applies."""

    found = [c for rule in RULES if (c := rule(backend))]
    return found or [Check("known-bad", OK, f"none of the {len(RULES)} known-bad combinations")]
