"""cuda implementations of the registry's ops (see gpucloud.hal.ops).

The reference attention is torch's SDPA, which on cuda already dispatches to its own flash
and memory-efficient kernels; the flash-attn package, when installed, reads the
[batch, seq, heads, head_dim] layout and grouped KV heads as they are (no transposes) and
runs sliding windows without a mask. Imported on any machine: flash_attn is imported only
when the op runs, which happens only where it is installed.
"""

from __future__ import annotations

import torch

from gpucloud.hal import ops

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


@ops.register("causal_attention", backend="cuda", name="flash-attn", requires="flash_attn")
def causal_attention_flash(q, k, v, window=None):
    """flash-attn in 16-bit on head dims up to 256; anything else takes the reference."""
    if q.dtype not in _FLASH_DTYPES or q.shape[-1] > 256:
        return ops.causal_attention(q, k, v, window)
    from flash_attn import flash_attn_func

    left = -1 if window is None else window - 1  # the query itself is one of the window
    return flash_attn_func(q, k, v, causal=True, window_size=(left, 0))
