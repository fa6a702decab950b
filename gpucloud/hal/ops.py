"""Operator registry: one signature per op, a reference torch implementation, and optional
faster implementations per backend, chosen once by `get(op)`.

Models call `ops.get("rms_norm")(x, weight, eps)` at construction time and keep the function,
so dispatch costs nothing per call. A fused kernel for a backend registers itself with
`@register("rms_norm", backend="cuda")` and is picked up wherever that backend is detected.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpucloud.errors import unknown_name
from gpucloud.hal import device

REFERENCE = "reference"
_REGISTRY: dict[str, dict[str, Callable]] = {}


def register(op: str, backend: str = REFERENCE) -> Callable[[Callable], Callable]:
    """Decorator: register `fn` as the implementation of `op` on `backend`."""

    def deco(fn: Callable) -> Callable:
        _REGISTRY.setdefault(op, {})[backend] = fn
        return fn

    return deco


def get(op: str, backend: str | None = None) -> Callable:
    """The implementation of `op` for `backend` (default: the detected one), else the reference."""
    impls = _REGISTRY.get(op)
    if impls is None:
        raise unknown_name("op", op, _REGISTRY)
    name = backend or device.detect().name
    return impls.get(name, impls[REFERENCE])


def available() -> dict[str, list[str]]:
    """Each op and the backends that have their own implementation of it."""
    return {op: sorted(impls) for op, impls in _REGISTRY.items()}


@register("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back, as Llama does."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


@register("silu_and_mul")
def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@register("rotary")
def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply rotary embeddings, half-split (GPT-NeoX / HF Llama) layout.

    x: [..., seq, heads, head_dim]; cos, sin: [seq, head_dim] broadcast over heads.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    return x * cos + rotated * sin


@register("causal_attention")
def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal self-attention over a padded batch with grouped KV heads.

    q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim].
    Returns [batch, seq, heads, head_dim].
    """
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]
    )
    return out.transpose(1, 2)
