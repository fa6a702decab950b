"""The KV block pool's bookkeeping: which block holds what, who uses it, what can be reused.

The runner owns the tensors; this module only hands out block ids. Each block has a
reference count (siblings of an `n > 1` request and requests with a common prefix share
blocks). With prefix caching, every full block is named by a chained hash of its tokens and
its parent block's hash; a freed block keeps its contents and its name, stays findable,
and is only overwritten when the pool needs it (least recently freed first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from gpucloud.serve.sequence import Sequence


@dataclass(slots=True, eq=False)
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered in the prefix cache
    tokens: tuple[int, ...] | None = None  # kept to rule out hash collisions on a hit


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Name of a full block: its tokens and, through the parent's name, every token before
    (for the first block, the parent is the sequence's cache salt: its LoRA adapter)."""
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the front is overwritten first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, Block] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0

    # ---- state -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences (free cached blocks do not count)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation --------------------------------------------------------------
    def allocate_new(self, seq: Sequence, budget: int) -> int | None:
        """Give a sequence that holds no blocks its reusable prefix plus room for up to
        `budget` more of its tokens. Reuse comes from the prefix cache or, for a sibling of
        an `n > 1` request, from the parent's prompt blocks; a sequence that still needs
        prompt logprobs reuses nothing (it needs the logits of every prompt position, so it
        computes them all, and registers its blocks for others as usual). Returns the number
        of tokens already computed, or None (and changes nothing) when the pool lacks free
        blocks.
        """
        shared = [] if seq.needs_prompt_logprobs else self._reusable_prefix(seq)
        computed = len(shared) * self.block_size
        end = min(seq.num_tokens, computed + budget)
        needed = self.blocks_for(end) - len(shared)
        revived = sum(1 for b in shared if b.ref_count == 0)
        if needed > len(self._free) - revived:
            return None
        for b in shared:
            if b.ref_count == 0:
                del self._free[b.id]
            b.ref_count += 1
        seq.block_table = [b.id for b in shared]
        seq.num_cached_blocks = len(shared)
        self._grow(seq, needed)
        if self.enable_prefix_caching:
            self.queried_tokens += seq.num_tokens  # after a preemption: outputs too
            self.hit_tokens += computed
        return computed

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Make the sequence's table cover `num_tokens` tokens; False (no change) if it can't."""
        needed = self.blocks_for(num_tokens) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > len(self._free):
            return False
        self._grow(seq, needed)
        return True

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks. Its tail goes to the front of the eviction order: the
        head of a prompt is the part other requests are most likely to share."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table = []
        seq.num_cached_blocks = 0

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` tokens (they hold nothing named:
        only computed full blocks are registered). They go to the front of the eviction
        order."""
        keep = self.blocks_for(num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)
        del seq.block_table[keep:]

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_cached_blocks:
            return
        self._extend_hashes(seq, full)
        for i in range(seq.num_cached_blocks, full):
            block = self.blocks[seq.block_table[i]]
            h = seq.block_hashes[i]
            if block.hash is None and h not in self._cached:
                block.hash = h
                block.tokens = self._tokens(seq, i)
                self._cached[h] = block
        seq.num_cached_blocks = full

    # ---- internals ---------------------------------------------------------------
    def _grow(self, seq: Sequence, count: int) -> None:
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict: its contents are about to be overwritten
                if self._cached.get(block.hash) is block:
                    del self._cached[block.hash]
                block.hash = block.tokens = None
            block.ref_count = 1
            seq.block_table.append(block_id)

    def _reusable_prefix(self, seq: Sequence) -> list[Block]:
        # At least one token must be computed to produce logits, so the last prompt token
        # never comes from the cache.
        limit = (seq.num_tokens - 1) // self.block_size
        if self.enable_prefix_caching:
            self._extend_hashes(seq, limit)
            hits = []
            for i in range(limit):
                block = self._cached.get(seq.block_hashes[i])
                if block is None or block.tokens != self._tokens(seq, i):
                    break
                hits.append(block)
            return hits
        parent = seq.parent
        if parent is not None and parent.num_computed_tokens >= parent.num_prompt_tokens:
            count = min(limit, parent.num_prompt_tokens // self.block_size)
            return [self.blocks[i] for i in parent.block_table[:count]]
        return []

    def _extend_hashes(self, seq: Sequence, count: int) -> None:
        hashes = seq.block_hashes
        while len(hashes) < count:
            parent = hashes[-1] if hashes else seq.cache_salt
            hashes.append(block_hash(parent, self._tokens(seq, len(hashes))))

    def _tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(seq.token_ids[start : start + self.block_size])
