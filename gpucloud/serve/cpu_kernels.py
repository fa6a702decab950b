"""Compiled kernels of the cpu backend: paged-attention decode and the int4 matmul.

The reference decode op (gpucloud.hal.ops) gathers each sequence's blocks into a padded
copy and then attends; on CPU that copy costs more than the attention itself. The kernel
reads the blocks in place, one (sequence, KV head) per task on torch's thread pool. The
reference int4 op dequantizes the whole weight on every call; the kernel reads the packed
nibbles (`kernels/int4_linear.cpp`), for the few rows of a decode step, where reading the
weight is the cost. Both are built with torch's C++ extension toolchain on first use (14 s
of CPU time, 11 s on two cores; then cached in KERNEL_DIR; `make test` builds them before
pytest starts); where no compiler is available the reference ops stay.

A sandboxed replica must not compile code the next tenant's replica would load, nor spend
its own time on it: the control plane shows it the builds of its own user read-only
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
_SOURCES = [Path(__file__).with_name("kernels") / name
            for name in ("paged_attention.cpp", "int4_linear.cpp", "bindings.cpp")]  # fmt: skip
# Up to this many rows the int4 kernel beats dequantizing (a decode step's batch); a
# prefill's matmul is compute bound, and the dequantized weight goes to the BLAS.
INT4_KERNEL_ROWS = 16


_CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def _build_name() -> str:
    """One cached build per source paths, contents and flags: torch rebuilds an extension of
    the same name whenever its source path changes, so two checkouts on one machine would
    otherwise take turns recompiling it."""
    h = hashlib.sha256()
    for source in _SOURCES:
        h.update(str(source.resolve()).encode())
        h.update(source.read_bytes())
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
    library = build_dir / f"{name}.so"
    # A finished build of these very sources (the name hashes them) loads as it is: torch's
    # `load` would first take the build directory's lock, which a builder killed mid-way
    # leaves behind, and then wait on it for ever.
    if library.is_file() or os.environ.get("GPUCLOUD_KERNEL_BUILD") == "0":
        return _prebuilt(name, library)
    from torch.utils.cpp_extension import load

    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        return load(name, [str(s) for s in _SOURCES], extra_cflags=_CFLAGS,
                    build_directory=str(build_dir))  # fmt: skip
    except Exception as e:  # a missing compiler or headers: fall back, do not fail serving
        log.warning("cpu kernels unavailable, using the torch references: %s", e)
        return None


def _prebuilt(name: str, library: Path):
    """The build at `library`, loaded as is; None (the reference op) when there is none."""
    if not library.is_file():
        log.warning("no prebuilt cpu kernels at %s: using the torch references", library)
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


@ops.register("int4_linear", backend="cpu", name="cpp-int4", ready=built)
def int4_linear(x, qweight, scales, zeros, group_size, bias):
    """Chosen only when built; fp32 decode batches (up to INT4_KERNEL_ROWS rows) on the CPU,
    else the reference."""
    module = _module()
    rows = x.numel() // x.shape[-1]
    if (module is None or x.dtype != torch.float32 or scales.dtype != torch.float32
            or x.device.type != "cpu" or rows > INT4_KERNEL_ROWS):  # fmt: skip
        return ops.int4_linear(x, qweight, scales, zeros, group_size, bias)
    y = module.int4_linear(x.reshape(rows, -1).contiguous(), qweight, scales, zeros, group_size)
    y = y.view(*x.shape[:-1], -1)
    return y if bias is None else y + bias


if __name__ == "__main__":  # the control plane's builder: python -m gpucloud.serve.cpu_kernels
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(0 if _module() is not None else 1)
