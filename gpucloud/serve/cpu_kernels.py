"""A compiled paged-attention decode kernel for the cpu backend.

The reference op (gpucloud.hal.ops) gathers each sequence's blocks into a padded copy and
then attends; on CPU that copy costs more than the attention itself. This kernel reads the
blocks in place, one (sequence, KV head) per task on torch's thread pool. It is built with
torch's C++ extension toolchain on first use (a minute, then cached in KERNEL_DIR); where
no compiler is available the reference op stays in place.

A sandboxed replica must not compile code the next tenant's replica would load, nor spend a
minute of its own on it: the control plane shows it the builds of its own user read-only
(`GPUCLOUD_KERNEL_DIR`) with `GPUCLOUD_KERNEL_BUILD=0`, which loads a build found there and
otherwise keeps the reference op. `python -m gpucloud.serve.cpu_kernels` builds it. The op
registry (gpucloud.hal.ops) imports this module for the cpu backend and picks the kernel once
a build is on disk; the engine builds it (`build()`) before it takes its ops.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from functools import cache
from pathlib import Path

import torch

from gpucloud.hal import ops

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("kernels") / "paged_attention.cpp"


_CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def _build_name() -> str:
    """One cached build per source path, content and flags: torch rebuilds an extension of
    the same name whenever its source path changes, so two checkouts on one machine would
    otherwise take turns recompiling it (a minute each)."""
    h = hashlib.sha256(str(_SOURCE.resolve()).encode())
    h.update(_SOURCE.read_bytes())
    h.update(" ".join(_CFLAGS).encode())
    h.update(torch.__version__.encode())  # the build links against this torch
    return f"gpucloud_paged_attention_{h.hexdigest()[:12]}"


def kernel_dir() -> Path:
    """Where builds live, one subdir per build name."""
    default = Path.home() / ".cache" / "gpucloud" / "kernels"
    return Path(os.environ.get("GPUCLOUD_KERNEL_DIR") or default)


@cache
def _module():
    name = _build_name()
    build_dir = kernel_dir() / name
    if os.environ.get("GPUCLOUD_KERNEL_BUILD") == "0":
        return _prebuilt(name, build_dir / f"{name}.so")
    from torch.utils.cpp_extension import load

    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        return load(name, [str(_SOURCE)], extra_cflags=_CFLAGS, build_directory=str(build_dir))
    except Exception as e:  # a missing compiler or headers: fall back, do not fail serving
        log.warning("paged attention kernel unavailable, using the torch reference: %s", e)
        return None


def _prebuilt(name: str, library: Path):
    """The build at `library`, loaded as is; None (the reference op) when there is none."""
    if not library.is_file():
        log.warning("no prebuilt paged attention kernel at %s: using the torch reference", library)
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def built() -> bool:
    """Whether a build of this source is on disk (cheap: nothing is compiled or loaded)."""
    name = _build_name()
    return (kernel_dir() / name / f"{name}.so").is_file()


def build() -> bool:
    """Build the kernel if it is not built yet (and building is allowed); False when it
    cannot be had, and the cpu backend keeps the reference op."""
    return _module() is not None


@ops.register("paged_attention_decode", backend="cpu", name="cpp-paged-decode", ready=built)
def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale, window=None):
    """Chosen only when built; fp32 on the CPU over whole contexts, else the reference (the
    kernel attends to whole contexts: a sliding window longer ago takes the reference)."""
    module = _module()
    past_window = window is not None and int(context_lens.max()) > window
    if module is None or q.dtype != torch.float32 or q.device.type != "cpu" or past_window:
        return ops.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens,
                                          scale, window)  # fmt: skip
    return module.paged_decode(q.contiguous(), k_cache, v_cache, block_tables, context_lens,
                               scale)  # fmt: skip


if __name__ == "__main__":  # the control plane's builder: python -m gpucloud.serve.cpu_kernels
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(0 if _module() is not None else 1)
