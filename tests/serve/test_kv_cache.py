"""Block manager: reference counts, prefix hits through chained hashes, LRU eviction."""

from __future__ import annotations

from gpucloud.serve.kv_cache import BlockManager
from gpucloud.serve.params import SamplingParams
from gpucloud.serve.sequence import Sequence

BS = 4


def seq(tokens: list[int], parent: Sequence | None = None) -> Sequence:
    return Sequence("r", 0, SamplingParams(), list(tokens), len(tokens), parent=parent)


def computed(manager: BlockManager, s: Sequence) -> Sequence:
    """Pretend the model ran over all of s's tokens."""
    s.num_computed_tokens = s.num_tokens
    manager.commit(s)
    return s


def test_allocation_covers_the_budget_and_free_returns_every_block():
    m = BlockManager(8, BS, enable_prefix_caching=False)
    a = seq(list(range(10)))
    assert m.allocate_new(a, budget=6) == 0
    assert len(a.block_table) == 2  # 6 tokens → 2 blocks
    assert m.allocate(a, 10) and len(a.block_table) == 3
    assert m.num_free == 5
    m.free(a)
    assert m.num_free == 8 and a.block_table == []


def test_allocation_fails_without_side_effects_when_the_pool_is_short():
    m = BlockManager(2, BS, enable_prefix_caching=False)
    a, b = seq(list(range(8))), seq(list(range(100, 105)))
    assert m.allocate_new(a, budget=8) == 0
    assert m.allocate_new(b, budget=5) is None
    assert b.block_table == [] and m.num_free == 0
    assert not m.allocate(a, 9) and len(a.block_table) == 2


def test_a_cached_prefix_is_reused_up_to_the_last_token():
    m = BlockManager(16, BS, enable_prefix_caching=True)
    a = computed(m, seq(list(range(10)), None))
    m.allocate_new(a, 0)  # (a already computed: only to give it blocks for the test)
    first = seq(list(range(10)))
    assert m.allocate_new(first, budget=10) == 0  # nothing cached yet
    computed(m, first)
    same = seq(list(range(10)))
    assert m.allocate_new(same, budget=10) == 8  # 2 full blocks; the rest is computed
    assert same.block_table[:2] == first.block_table[:2]
    assert m.blocks[first.block_table[0]].ref_count == 2
    exact = seq(list(range(8)))  # the whole prompt cached: its last block is recomputed
    assert m.allocate_new(exact, budget=8) == 4
    other = seq([0, 1, 2, 3, 99, 5, 6, 7, 8])
    assert m.allocate_new(other, budget=9) == 4  # diverges in the second block
    assert m.hit_tokens == 16 and m.queried_tokens == 10 + 10 + 8 + 9 + 10


def test_the_chain_makes_a_block_depend_on_everything_before_it():
    m = BlockManager(16, BS, enable_prefix_caching=True)
    a = seq([1, 1, 1, 1, 2, 2, 2, 2, 0])
    m.allocate_new(a, budget=9)
    computed(m, a)
    b = seq([3, 3, 3, 3, 2, 2, 2, 2, 0])  # same second block, different first one
    assert m.allocate_new(b, budget=9) == 0


def test_freed_cached_blocks_stay_reusable_until_evicted_least_recent_first():
    m = BlockManager(4, BS, enable_prefix_caching=True)
    a = seq(list(range(9)))
    m.allocate_new(a, budget=9)
    computed(m, a)
    head_block, second_block = a.block_table[:2]
    m.free(a)
    assert m.num_free == 4 and m.usage == 0.0
    again = seq(list(range(9)))
    assert m.allocate_new(again, budget=9) == 8  # revived from the free list
    m.free(again)
    # Eviction order: the never-cached blocks, then a's tail before its head.
    stranger = seq(list(range(100, 108)))
    m.allocate_new(stranger, budget=8)
    assert head_block not in stranger.block_table and second_block not in stranger.block_table
    head = seq(list(range(5)))
    assert m.allocate_new(head, budget=5) == 4  # the head block is still cached...
    assert head.block_table == [head_block, second_block]  # ...and the tail was evicted
    assert m.blocks[second_block].hash is None


def test_siblings_share_the_parents_prompt_blocks_without_prefix_caching():
    m = BlockManager(8, BS, enable_prefix_caching=False)
    parent = seq(list(range(10)))
    m.allocate_new(parent, budget=10)
    parent.num_computed_tokens = 10
    child = seq(list(range(10)), parent=parent)
    assert m.allocate_new(child, budget=10) == 8
    assert child.block_table[:2] == parent.block_table[:2]
    assert len(child.block_table) == 3 and child.block_table[2] != parent.block_table[2]
    m.free(parent)
    assert m.blocks[child.block_table[0]].ref_count == 1
