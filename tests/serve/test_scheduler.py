"""The batch scheduler on its own, with fabricated model outputs (no model runs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpucloud.serve.config import EngineConfig
from gpucloud.serve.kv_cache import BlockManager
from gpucloud.serve.params import SamplingParams
from gpucloud.serve.scheduler import Scheduler
from gpucloud.serve.sequence import FinishReason, Sequence, Status


def make(num_blocks=64, block_size=4, caching=False, **config) -> Scheduler:
    cfg = EngineConfig(block_size=block_size, kv_cache_bytes=1, **config)
    return Scheduler(cfg, BlockManager(num_blocks, block_size, caching))


def seq(name: str, prompt_len: int) -> Sequence:
    tokens = [hash((name, i)) % 1000 for i in range(prompt_len)]
    return Sequence(name, 0, SamplingParams(), tokens, prompt_len)


def step(s: Scheduler, token: int = 7):
    """Schedule, 'run' and append a token to every sampling chunk."""
    out = s.schedule()
    s.update(out)
    for c in out.chunks:
        if c.samples:
            c.seq.append(token)
    return out


def plan(out) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks]


def test_a_long_prompt_is_chunked_and_decodes_keep_running():
    s = make(max_num_batched_tokens=10)
    a, b = seq("a", 3), seq("b", 25)
    s.add(a)
    s.add(b)
    assert plan(step(s)) == [("a", 0, 3), ("b", 0, 7)]
    assert plan(step(s)) == [("a", 3, 1), ("b", 7, 9)]  # a decodes while b's prompt goes on
    assert plan(step(s)) == [("a", 4, 1), ("b", 16, 9)]
    assert b.num_output_tokens == 1  # the last chunk reached the end of the prompt: sampled
    assert plan(step(s)) == [("a", 5, 1), ("b", 25, 1)]
    assert a.num_output_tokens == 4 and b.num_output_tokens == 2


def test_budget_and_max_num_seqs_bound_every_step():
    s = make(max_num_batched_tokens=16, max_num_seqs=3)
    seqs = [seq(str(i), 6) for i in range(5)]
    for x in seqs:
        s.add(x)
    for _ in range(6):
        out = step(s)
        assert out.num_rows <= 16
        assert len(s.running) <= 3
    assert [x.status for x in seqs[:3]] == [Status.RUNNING] * 3  # first come, first served
    assert seqs[3].status is Status.WAITING


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    s = make(max_num_batched_tokens=10, enable_chunked_prefill=False)
    a, b = seq("a", 6), seq("b", 6)
    s.add(a)
    s.add(b)
    assert plan(step(s)) == [("a", 0, 6)]
    assert plan(step(s)) == [("a", 6, 1), ("b", 0, 6)]


def test_out_of_blocks_preempts_the_latest_sequence_and_recomputes_it():
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = seq("a", 7), seq("b", 7)  # 2 blocks each: the pool is full after prefill
    s.add(a)
    s.add(b)
    step(s)  # both prefilled, each sampled its first token
    step(s)  # position 7 still fits in the second block
    assert len(s.running) == 2 and s.blocks.num_free == 0
    out = step(s)  # a's position 8 needs a 3rd block: b (started last) is preempted
    assert out.preempted == [b] and s.num_preemptions == 1
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert plan(out) == [("a", 8, 1)]
    s.finish(a, FinishReason.LENGTH)
    out = step(s)
    assert plan(out) == [("b", 0, 9)]  # prompt + its output so far, recomputed in one go
    assert b.num_output_tokens == 3


def test_a_sequence_alone_in_the_pool_preempts_itself_rather_than_hang():
    s = make(num_blocks=2, block_size=4, max_num_batched_tokens=64)
    a = seq("a", 8)
    s.add(a)
    step(s)
    out = s.schedule()  # needs a 3rd block that does not exist
    assert out.preempted == [a] and out.chunks == []


def test_siblings_wait_for_the_parent_prompt_then_share_it():
    s = make(max_num_batched_tokens=6)
    parent = seq("p", 9)
    child = Sequence("p", 1, SamplingParams(), list(parent.token_ids), 9, parent=parent)
    s.add(parent)
    s.add(child)
    assert plan(step(s)) == [("p", 0, 6)]  # the child waits for the prompt
    assert plan(step(s)) == [("p", 6, 3)]
    out = step(s)
    assert [c.seq.index for c in out.chunks] == [0, 1]
    assert plan(out)[1] == ("p", 8, 1)  # two full blocks reused, one token recomputed
    assert child.block_table[:2] == parent.block_table[:2]


def test_finish_frees_blocks_and_counts_are_consistent():
    s = make(num_blocks=8)
    a = seq("a", 5)
    s.add(a)
    step(s)
    s.finish(a, FinishReason.STOP, 7)
    assert a.finished and a.finish_reason is FinishReason.STOP and a.stop_reason == 7
    assert s.blocks.num_free == 8 and not s.has_unfinished()


def test_drafts_take_only_the_budget_and_blocks_the_running_sequences_left():
    s = make(num_blocks=5, block_size=4, max_num_batched_tokens=16)
    a, b = seq("a", 3), seq("b", 3)
    s.add(a)
    s.add(b)
    step(s)  # both prompts; each holds one block and 4 tokens
    a.draft_token_ids = [1] * 13  # 17 tokens need 5 blocks: 4 more, only 3 are free
    out = s.schedule()
    assert plan(out) == [("a", 3, 1), ("b", 3, 1)] and out.chunks[0].draft == []
    assert not out.preempted and s.blocks.num_free == 3
    s.update(out)
    for c in out.chunks:
        c.seq.append(7)
    a.draft_token_ids = [1] * 5  # 10 tokens, 3 blocks: one more, and one is left
    out = s.schedule()
    assert out.chunks[0].draft == [1] * 5 and out.num_rows == 7 and s.blocks.num_free == 0
    s = make(max_num_batched_tokens=4)
    c = seq("c", 3)
    s.add(c)
    step(s)
    c.draft_token_ids = [1] * 5
    assert s.schedule().chunks[0].draft == [1] * 3  # the budget's leftover


def prioritized(name: str, prompt_len: int, priority: int) -> Sequence:
    x = seq(name, prompt_len)
    x.priority = priority
    return x


def test_waiting_sequences_queue_by_priority_then_arrival():
    s = make(max_num_seqs=1)
    for x in (prioritized("b1", 3, 1), prioritized("i1", 3, 0), prioritized("b2", 3, 1),
              prioritized("i2", 3, 0)):  # fmt: skip
        s.add(x)
    assert [x.request_id for x in s.waiting] == ["i1", "i2", "b1", "b2"]


def test_a_better_request_awaiting_its_first_token_pauses_worse_ones():
    s = make(max_num_batched_tokens=16)
    batch = [prioritized(f"b{i}", 5, 1) for i in range(2)]
    for x in batch:
        s.add(x)
    step(s)  # both batch prompts computed: they decode
    assert plan(step(s)) == [("b0", 5, 1), ("b1", 5, 1)]
    s.add(prioritized("i", 6, 0))
    assert plan(step(s)) == [("i", 0, 6)]  # alone: the batch rows pause, blocks kept
    assert [x.status for x in batch] == [Status.RUNNING] * 2 and s.num_preemptions == 0
    assert plan(step(s)) == [("i", 6, 1), ("b0", 6, 1), ("b1", 6, 1)]  # its token came


@pytest.mark.parametrize("num_blocks, max_num_seqs", [(4, 8), (64, 2)], ids=["blocks", "seat"])
def test_a_better_request_preempts_worse_ones_for_blocks_or_a_seat(num_blocks, max_num_seqs):
    s = make(num_blocks=num_blocks, block_size=4, max_num_seqs=max_num_seqs)
    batch = [prioritized(f"b{i}", 7, 1) for i in range(2)]  # 2 blocks each: the pool is full
    for x in batch:
        s.add(x)
    step(s)
    s.add(prioritized("i", 3, 0))
    out = step(s)
    assert out.preempted == [batch[1]] and plan(out) == [("i", 0, 3)]  # the latest batch one
    assert s.waiting[0] is batch[1] and batch[1].num_computed_tokens == 0


def test_a_better_request_that_cannot_run_does_not_stop_the_others():
    s = make(max_loras=1)
    batch = prioritized("b", 5, 1)
    batch.lora = SimpleNamespace(id=1)
    s.add(batch)
    step(s)
    stuck = prioritized("i", 3, 0)  # another adapter, while the batch one holds the only slot
    stuck.lora = SimpleNamespace(id=2)
    s.add(stuck)
    assert plan(step(s)) == [("b", 5, 1)] and stuck.status is Status.WAITING
