"""Operator registry: one signature per op, a reference torch implementation, and faster
implementations per backend, chosen by capability.

Each backend (cpu, cuda, npu, ...) has, per op, a list of implementations in order of
preference, each with what it needs (an importable module, a built kernel); `choose(op,
backend)` takes the first one this machine can run, else the reference. Models and the engine
call `ops.get("rms_norm")` at construction time and keep the function, so the choice is made
once and dispatch costs nothing per call; `table(backend)` shows the choice for every op.

Backend implementations live in provider modules, imported the first time their backend is
asked about. A provider never imports its vendor library at import time (only inside the
implementation, which runs only where `requires` is importable), so a CPU machine can list
the npu table without importing torch_npu.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpucloud.errors import unknown_name
from gpucloud.hal import device

REFERENCE = "reference"
# Modules that register a backend's implementations, imported on first use of that backend.
# The cpu paged-attention kernel lives with the engine that builds it (gpucloud.serve).
PROVIDERS: dict[str, tuple[str, ...]] = {
    "cpu": ("gpucloud.serve.cpu_kernels",),
    "cuda": ("gpucloud.hal.ops_cuda",),
    "npu": ("gpucloud.hal.ops_npu",),
}


@dataclass(frozen=True, slots=True)
class Impl:
    """One implementation of an op on a backend."""

    op: str
    backend: str
    name: str
    fn: Callable
    requires: str | None = None  # a module it imports when called (checked, not imported)
    ready: Callable[[], bool] | None = None  # any other condition, e.g. a kernel is built

    def available(self) -> bool:
        """Whether this machine can run it (its backend's device aside)."""
        if self.requires and importlib.util.find_spec(self.requires) is None:
            return False
        return self.ready is None or self.ready()


_REGISTRY: dict[str, dict[str, list[Impl]]] = {}
_loaded_providers: set[str] = set()
_forced: ContextVar[str | None] = ContextVar("gpucloud_ops_backend", default=None)


def register(
    op: str,
    backend: str = REFERENCE,
    name: str | None = None,
    requires: str | None = None,
    ready: Callable[[], bool] | None = None,
) -> Callable[[Callable], Callable]:
    """Decorator: register `fn` as an implementation of `op` on `backend`, after (less
    preferred than) the ones registered before it; re-registering a name replaces it."""

    def deco(fn: Callable) -> Callable:
        impl = Impl(op, backend, name or (REFERENCE if backend == REFERENCE else fn.__name__),
                    fn, requires, ready)  # fmt: skip
        impls = _REGISTRY.setdefault(op, {}).setdefault(backend, [])
        impls[:] = [i for i in impls if i.name != impl.name] + [impl]
        return fn

    return deco


def _load_providers(backend: str) -> None:
    if backend in _loaded_providers:
        return
    _loaded_providers.add(backend)
    for module in PROVIDERS.get(backend, ()):
        importlib.import_module(module)


def implementations(op: str, backend: str) -> list[Impl]:
    """`op`'s own implementations on `backend`, most preferred first (the reference aside)."""
    if op not in _REGISTRY:
        raise unknown_name("op", op, _REGISTRY)
    _load_providers(backend)
    return list(_REGISTRY[op].get(backend, []))


def choose(op: str, backend: str) -> Impl:
    """The implementation `backend` uses for `op`: its first available one, else the reference."""
    if op not in _REGISTRY:
        raise unknown_name("op", op, _REGISTRY)
    candidates = [] if backend == REFERENCE else implementations(op, backend)
    reference = _REGISTRY[op][REFERENCE][0]
    return next((i for i in candidates if i.available()), reference)


def get(op: str, backend: str | None = None) -> Callable:
    """The function `op` runs on `backend`; default: the one `using()` names, else the
    detected backend."""
    return choose(op, backend or _forced.get() or device.detect().name).fn


def table(backend: str) -> dict[str, str]:
    """{op: name of the implementation `backend` uses}, for every op."""
    return {op: choose(op, backend).name for op in sorted(_REGISTRY)}


def op_names() -> list[str]:
    return sorted(_REGISTRY)


@contextmanager
def using(backend: str) -> Iterator[None]:
    """Make `get(op)` pick `backend`'s implementations (e.g. REFERENCE for every op) for
    models built inside the block."""
    token = _forced.set(backend)
    try:
        yield
    finally:
        _forced.reset(token)


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


def window_mask(query_positions: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """[queries, keys] bool: key j is visible from the query at position p when j <= p and,
    on a sliding-window layer, p - j < window (the query itself counts)."""
    keys = torch.arange(num_keys, device=query_positions.device)[None, :]
    rows = query_positions[:, None]
    mask = keys <= rows
    return mask if window is None else mask & (keys > rows - window)


@register("causal_attention")
def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """Causal self-attention over a padded batch with grouped KV heads; with `window`, each
    query sees only the last `window` positions (itself included).

    q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim].
    Returns [batch, seq, heads, head_dim].
    """
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    seq, gqa = q.shape[2], k.shape[1] != q.shape[1]
    if window is None or window >= seq:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        mask = window_mask(torch.arange(seq, device=q.device), seq, window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return out.transpose(1, 2)


@register("document_attention")
def document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor
) -> torch.Tensor:
    """Causal attention over packed rows: a token sees only earlier tokens of its own
    document. `documents` [batch, seq] numbers each token's document within its row.

    q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim].
    Returns [batch, seq, heads, head_dim].
    """
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    seq, gqa = q.shape[2], k.shape[1] != q.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    mask = (documents[:, :, None] == documents[:, None, :]) & causal
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=gqa)
    return out.transpose(1, 2)


# ---- paged attention (serving) ------------------------------------------------------------
# The KV cache of one layer is a pool of blocks laid out [kv_heads, num_blocks, block_size,
# head_dim]: gathering a sequence's blocks along dim 1 yields [kv_heads, tokens, head_dim]
# directly, the layout attention wants, with no transpose copy.


@register("write_kv_cache")
def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Store k, v ([tokens, kv_heads, head_dim]) at flat slots (block * block_size + offset)."""
    heads, dim = k_cache.shape[0], k_cache.shape[-1]
    k_cache.view(heads, -1, dim).index_copy_(1, slots, k.transpose(0, 1))
    v_cache.view(heads, -1, dim).index_copy_(1, slots, v.transpose(0, 1))


@register("paged_attention_decode")
def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence against its cached keys (the last `window` of them on a
    sliding-window layer).

    q: [seqs, heads, head_dim]; block_tables: [seqs, max_blocks] (padded with any valid block);
    context_lens: [seqs], keys per sequence. The query heads sharing a KV head become extra
    query rows, so grouped-query attention needs no repeated keys. Returns like q.
    """
    seqs, heads, dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    flat = block_tables.reshape(-1)
    k = k_cache.index_select(1, flat).view(kv_heads, seqs, -1, dim).transpose(0, 1)
    v = v_cache.index_select(1, flat).view(kv_heads, seqs, -1, dim).transpose(0, 1)
    q = q.view(seqs, kv_heads, heads // kv_heads, dim)
    mask = window_mask(context_lens - 1, k.shape[2], window)[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(seqs, heads, dim)


@register("paged_attention_prefill")
def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """A chunk of one sequence's queries at positions start.. against its cached keys
    (the last `window` of them on a sliding-window layer).

    q: [chunk, heads, head_dim]; block_table: [blocks] covering positions 0..start+chunk-1,
    whose K/V are already in the cache. Returns [chunk, heads, head_dim].
    """
    chunk, heads, dim = q.shape
    total = start + chunk
    k = k_cache.index_select(1, block_table).flatten(1, 2)[:, :total]
    v = v_cache.index_select(1, block_table).flatten(1, 2)[:, :total]
    mask = window_mask(torch.arange(start, total, device=q.device), total, window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k[None],
        v[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=k.shape[0] != heads,
    )
    return out[0].transpose(0, 1)


@register("prefill_attention")
def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None
):
    """Causal attention of a chunk that starts a sequence: no cached keys to read.

    q: [chunk, heads, head_dim]; k, v: [chunk, kv_heads, head_dim]. Returns like q.
    """
    chunk = q.shape[0]
    windowed = window is not None and window < chunk
    mask = window_mask(torch.arange(chunk, device=q.device), chunk, window) if windowed else None
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=not windowed,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out[0].transpose(0, 1)


# ---- weight-only quantized linear layers ---------------------------------------------------
# int8: qweight [out, in] int8, one scale per output channel (symmetric): W = q · s.
# int4: qweight [out, in / 2] uint8, two input channels per byte (the even one in the low
# nibble); scales [out, groups] for groups of `group_size` input channels (the last may be
# shorter) and zero points [out, ⌈groups / 2⌉] packed the same way: W = (q - z) · s.
# A backend kernel takes the same tensors.
INT8_PACKED_ROWS = 16  # up to this many rows, torch's int8 CPU kernel beats dequantizing


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """[rows, n] uint8 → [rows, 2n] uint8 values 0..15, the low nibble first."""
    return torch.stack((qweight & 0xF, qweight >> 4), dim=-1).flatten(-2)


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The [out, in] weight of an int4 layer, in the scales' dtype: nibbles written straight
    into the output, then (q - z) · s in place (a third of the passes of doing it by parts)."""
    out, cols = qweight.shape[0], 2 * qweight.shape[1]
    w = torch.empty(out, cols, dtype=scales.dtype, device=qweight.device)
    w[:, 0::2] = qweight & 0xF
    w[:, 1::2] = qweight >> 4
    z = unpack_int4(zeros)[:, : scales.shape[1]].to(scales.dtype)
    if cols % group_size == 0:  # every group whole: broadcast over a [out, groups, size] view
        w.view(out, -1, group_size).sub_(z[..., None]).mul_(scales[..., None])
        return w
    spread = (z.repeat_interleave(group_size, dim=1)[:, :cols],
              scales.repeat_interleave(group_size, dim=1)[:, :cols])  # fmt: skip
    return w.sub_(spread[0]).mul_(spread[1])


@register("int8_linear")
def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ (q · s)ᵀ + bias: the scale applies to the output channel, after the matmul."""
    out = F.linear(x, qweight.to(x.dtype)) * scales
    return out if bias is None else out + bias


@register("int8_linear", backend="cpu", name="torch-int8pack")
def int8_linear_cpu(x, qweight, scales, bias):
    """torch's int8 weight kernel reads the int8 weight directly: faster than dequantizing for
    a few rows (decode), but only in 16-bit; fp32 and large batches take the reference."""
    rows = x.numel() // x.shape[-1]
    if x.dtype == torch.float32 or rows > INT8_PACKED_ROWS:
        return int8_linear(x, qweight, scales, bias)
    out = torch._weight_int8pack_mm(x.reshape(rows, -1), qweight, scales)
    out = out.view(*x.shape[:-1], -1)
    return out if bias is None else out + bias


@register("int4_linear")
def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x @ ((q - z) · s)ᵀ + bias, the weight dequantized for this call only."""
    return F.linear(x, dequantize_int4(qweight, scales, zeros, group_size), bias)


# ---- LoRA adapters (serving many at once) ----------------------------------------------------
@register("lora_add")
def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    groups: list[tuple[int, torch.Tensor]],
) -> torch.Tensor:
    """y += x @ Aᵀ @ Bᵀ with each token's adapter, in place; returns y.

    y: [tokens, out]; x: [tokens, in]; lora_a: [slots, rank, in]; lora_b: [slots, out, rank]
    (scaling folded in, unused ranks zero); groups: [(slot, rows)], the tokens of each slot
    (a token in no group has no adapter). Grouped by adapter: two small matmuls per adapter
    in the batch, instead of gathering a [rank, in] matrix per token.
    """
    for slot, rows in groups:
        if rows.numel() == x.shape[0]:  # the whole batch on one adapter: no gather
            y.addmm_(x @ lora_a[slot].T, lora_b[slot].T)
        else:
            delta = (x.index_select(0, rows) @ lora_a[slot].T) @ lora_b[slot].T
            y.index_add_(0, rows, delta)
    return y


@register("top_k_top_p")
def top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """The sampler's filter: `logits` [rows, vocab] with -inf past each row's top-k (int,
    1..vocab), past the top-p mass (the tokens whose more likely tokens already hold
    `top_p`) and below `min_p` times the most likely token's probability. The most likely
    token always survives; top_k = vocab, top_p = 1, min_p = 0 keep everything."""
    sorted_logits, order = logits.sort(-1, descending=True)
    keep = _kept(sorted_logits.float().softmax(-1), top_k, top_p, min_p)
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


@register("top_k_top_p", backend="cpu", name="partial-topk")
def top_k_top_p_partial(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """When every row has a top-k below the vocabulary, only the largest k logits need
    sorting (torch.topk, not a full sort): the same tokens survive."""
    k = int(top_k.max())
    if k >= logits.shape[-1]:
        return top_k_top_p(logits, top_k, top_p, min_p)
    values, order = logits.topk(k, dim=-1)
    probs = (values.float() - logits.float().logsumexp(-1, keepdim=True)).exp()
    keep = _kept(probs, top_k, top_p, min_p)
    out = torch.full_like(logits, float("-inf"))
    return out.scatter_(-1, order, values.masked_fill(~keep, float("-inf")))


def _kept(probs: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    """Which of the tokens, sorted most likely first with their float32 probabilities (16-bit
    ones would move the top-p boundary with their rounding), survive."""
    ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    before = probs.cumsum(-1) - probs  # mass of the more likely tokens
    drop = (ranks >= top_k[:, None]) | (before >= top_p[:, None])
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    return ~drop
