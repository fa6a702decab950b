"""Paged attention ops against plain attention over the same keys laid out contiguously."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpucloud.hal import ops
from gpucloud.serve import cpu_kernels

KV_HEADS, HEADS, DIM, BS, BLOCKS = 2, 8, 16, 4, 64


def pool(lengths: list[int], seed: int = 0):
    """A shuffled block pool holding each sequence's keys, and the contiguous truth."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(KV_HEADS, BLOCKS, BS, DIM, generator=gen)
    v_cache = torch.randn(KV_HEADS, BLOCKS, BS, DIM, generator=gen)
    order = torch.randperm(BLOCKS, generator=gen).tolist()
    width = max(-(-n // BS) for n in lengths)
    tables = [[order.pop() for _ in range(width)] for _ in lengths]
    return k_cache, v_cache, tables


def contiguous(cache, table, n):
    return cache[:, table].flatten(1, 2)[:, :n]  # [kv_heads, n, dim]


def reference_decode(q, k_cache, v_cache, tables, lengths):
    outs = []
    for i, n in enumerate(lengths):
        k, v = contiguous(k_cache, tables[i], n), contiguous(v_cache, tables[i], n)
        o = F.scaled_dot_product_attention(q[i][:, None], k, v, enable_gqa=True)
        outs.append(o[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("backend", [ops.REFERENCE, "cpu"])
def test_decode_matches_plain_attention(backend):
    if backend == "cpu" and not cpu_kernels.build():
        pytest.skip("no C++ toolchain to build the cpu kernel")
    lengths = [1, 5, 16, 23, 40]
    k_cache, v_cache, tables = pool(lengths)
    q = torch.randn(len(lengths), HEADS, DIM)
    op = ops.get("paged_attention_decode", backend)
    got = op(q, k_cache, v_cache, torch.tensor(tables), torch.tensor(lengths), DIM**-0.5)
    want = reference_decode(q, k_cache, v_cache, tables, lengths)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_prefill_of_a_later_chunk_sees_the_cached_prefix_causally():
    k_cache, v_cache, (table,) = pool([30])
    start, chunk = 18, 12
    q = torch.randn(chunk, HEADS, DIM)
    op = ops.get("paged_attention_prefill")
    got = op(q, k_cache, v_cache, torch.tensor(table[:8]), start, DIM**-0.5)
    k, v = contiguous(k_cache, table, 30), contiguous(v_cache, table, 30)
    mask = torch.ones(30, 30, dtype=torch.bool).tril()[start:]
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask,
                                          enable_gqa=True).transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_write_kv_cache_puts_tokens_at_their_slots():
    k_cache = torch.zeros(KV_HEADS, BLOCKS, BS, DIM)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(3, KV_HEADS, DIM), torch.randn(3, KV_HEADS, DIM)
    slots = torch.tensor([7 * BS + 2, 0, 63 * BS + 3])
    ops.get("write_kv_cache")(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[:, 7, 2], k[0]) and torch.equal(v_cache[:, 63, 3], v[2])
    assert torch.count_nonzero(k_cache) == 3 * KV_HEADS * DIM
