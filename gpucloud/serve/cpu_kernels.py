"""A compiled paged-attention decode kernel for the cpu backend.

The reference op (gpucloud.hal.ops) gathers each sequence's blocks into a padded copy and
then attends; on CPU that copy costs more than the attention itself. This kernel reads the
blocks in place, one (sequence, KV head) per task on torch's thread pool. It is built with
torch's C++ extension toolchain on first use (a minute, then cached); where no compiler is
available the reference op stays in place.
"""

from __future__ import annotations

import hashlib
import logging
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
    return f"gpucloud_paged_attention_{h.hexdigest()[:12]}"


@cache
def _module():
    from torch.utils.cpp_extension import load

    try:
        return load(_build_name(), [str(_SOURCE)], extra_cflags=_CFLAGS)
    except Exception as e:  # a missing compiler or headers: fall back, do not fail serving
        log.warning("paged attention kernel unavailable, using the torch reference: %s", e)
        return None


def register() -> bool:
    """Register the kernel as the cpu implementation; False when it cannot be built."""
    module = _module()
    if module is None:
        return False
    reference = ops.get("paged_attention_decode", ops.REFERENCE)

    @ops.register("paged_attention_decode", backend="cpu")
    def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale,
                               window=None):  # fmt: skip
        # The kernel attends to whole contexts: a sliding window longer ago takes the reference.
        past_window = window is not None and int(context_lens.max()) > window
        if q.dtype != torch.float32 or q.device.type != "cpu" or past_window:
            return reference(q, k_cache, v_cache, block_tables, context_lens, scale, window)
        return module.paged_decode(q.contiguous(), k_cache, v_cache, block_tables,
                                   context_lens, scale)  # fmt: skip

    return True
