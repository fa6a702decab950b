"""Iteration-level batch scheduling: which tokens of which sequences run in the next step.

Pure bookkeeping over `Sequence` counters and the block manager; no tensors, no clock.
Each step fills a token budget: running sequences first (one token each when decoding, a
chunk when their prompt is still being computed), then waiting ones in arrival order.
A prompt longer than the remaining budget is split into chunks, so decodes never stall
behind it. When the pool runs out of blocks, the most recently started sequence is
preempted: its blocks are freed and it is recomputed later from its tokens. At most
`max_loras` distinct LoRA adapters run at once: a waiting sequence whose adapter would be
one too many waits, and the ones behind it may start.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gpucloud.serve.config import EngineConfig
from gpucloud.serve.kv_cache import BlockManager
from gpucloud.serve.sequence import FinishReason, Sequence, Status


@dataclass(slots=True)
class Chunk:
    """`num_tokens` tokens of `seq` starting at position `start` run in this step, followed
    by `draft`: guessed tokens to verify (speculative decoding; only after a decode token)."""

    seq: Sequence
    start: int
    num_tokens: int
    draft: list[int] = field(default_factory=list)

    @property
    def input_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.start + self.num_tokens] + self.draft

    @property
    def num_rows(self) -> int:
        """Rows of the flattened batch: the tokens and the draft."""
        return self.num_tokens + len(self.draft)

    @property
    def completes(self) -> bool:
        """True when the chunk reaches the end of the known tokens."""
        return self.start + self.num_tokens == self.seq.num_tokens

    @property
    def samples(self) -> bool:
        """True when a new token is drawn after the chunk (not for a prompt scored alone)."""
        return self.completes and self.seq.params.max_tokens != 0


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        """Rows the step's forward runs: tokens and drafts, bounded by the token budget."""
        return sum(c.num_rows for c in self.chunks)


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            budget = self._schedule_drafts(out, budget)
            self._schedule_waiting(out, budget)
        return out

    def update(self, out: SchedulerOutput) -> None:
        """Record that the step computed every scheduled chunk (before tokens are appended).
        A draft's K/V counts only once `accept_draft_token` confirms it."""
        for chunk in out.chunks:
            chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
            self.blocks.commit(chunk.seq)

    def accept_draft_token(self, seq: Sequence) -> None:
        """The next draft token was right (and is appended): its K/V, computed by the step,
        is valid."""
        seq.num_computed_tokens += 1
        self.blocks.commit(seq)

    def drop_rejected(self, seq: Sequence) -> None:
        """Give back the blocks that only rejected draft tokens needed: the table ends as if
        the sequence had decoded without speculation (later tokens overwrite the K/V left
        in its last block)."""
        seq.draft_token_ids = []
        if seq.status is Status.RUNNING:
            self.blocks.truncate(seq, seq.num_computed_tokens)

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None):
        """End a sequence (stopped, too long or aborted) and free its blocks."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    # ---- internals ---------------------------------------------------------------
    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return budget
            out.chunks.append(Chunk(seq, seq.num_computed_tokens, n))
            budget -= n
            i += 1
        return budget

    def _schedule_drafts(self, out: SchedulerOutput, budget: int) -> int:
        """Attach speculative drafts to the chunks that end a sequence's known tokens, from
        the budget and free blocks the running sequences left: a draft never preempts
        anyone; without room, its sequence decodes one token."""
        for chunk in out.chunks:
            seq = chunk.seq
            if budget <= 0 or not seq.draft_token_ids or chunk.num_tokens != 1:
                continue
            draft = seq.draft_token_ids[:budget]
            if chunk.completes and self.blocks.allocate(seq, seq.num_tokens + len(draft)):
                chunk.draft = draft
                budget -= len(draft)
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        config = self.config
        adapters = {s.lora.id for s in self.running if s.lora is not None}
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < config.max_num_seqs:
            seq = self.waiting[0]
            if seq.lora is not None and seq.lora.id not in adapters:
                if len(adapters) >= config.max_loras:
                    skipped.append(self.waiting.popleft())
                    continue
                adapters.add(seq.lora.id)
            parent = seq.parent
            if (
                parent is not None
                and parent.status is Status.RUNNING
                and parent.num_computed_tokens < parent.num_prompt_tokens
            ):
                break  # let the parent finish its prompt, then share its blocks
            computed = self.blocks.allocate_new(seq, budget)
            if computed is None:
                break
            n = min(seq.num_tokens - computed, budget)
            if not config.enable_chunked_prefill and computed + n < seq.num_tokens:
                self.blocks.free(seq)
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            seq.num_computed_tokens = computed
            seq.draft_computed_tokens = 0  # new blocks: the draft model starts over
            seq.num_reused_tokens = min(computed, seq.num_prompt_tokens)
            self.running.append(seq)
            out.chunks.append(Chunk(seq, computed, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
