"""Iteration-level batch scheduling: which tokens of which sequences run in the next step.

Pure bookkeeping over `Sequence` counters and the block manager; no tensors, no clock.
Each step fills a token budget: running sequences first (one token each when decoding, a
chunk when their prompt is still being computed), then waiting ones in arrival order.
A prompt longer than the remaining budget is split into chunks, so decodes never stall
behind it. When the pool runs out of blocks, the most recently started sequence is
preempted: its blocks are freed and it is recomputed later from its tokens. At most
`max_loras` distinct LoRA adapters run at once: a waiting sequence whose adapter would be
one too many waits, and the ones behind it may start.

Each sequence has its request's `priority` (lower runs first; vLLM's convention, 0 unless
told). Waiting sequences queue by priority, then arrival; the worst running one is the first
preempted. While a sequence awaits its first token, sequences of a worse priority pause (no
row in the step, their blocks kept) and may be preempted to admit it, so a batch of
low-priority work does not lengthen a better request's time to first token. A step that
would run nothing that way runs everyone as usual.
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
        """Queue `seq` behind the waiting sequences of its priority and better ones."""
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].priority > seq.priority:
            i -= 1
        self.waiting.insert(i, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        # Stable: admission order within a priority; the last one is the first preempted.
        self.running.sort(key=_priority)
        cap = self._pause_above()
        if cap is not None:
            out = self._schedule(cap)
            if out.chunks or out.preempted:
                return out
        return self._schedule(None)

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
    def _schedule(self, cap: int | None) -> SchedulerOutput:
        """The step's chunks for sequences of priority `cap` or better (None: all)."""
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens, cap)
        if not out.preempted:
            budget = self._schedule_drafts(out, budget)
            self._schedule_waiting(out, budget, cap)
        return out

    def _pause_above(self) -> int | None:
        """The best priority among sequences awaiting their first token, if some sequence
        has a worse one (those pause this step); else None."""
        ends = [q[i].priority for q in (self.running, self.waiting) if q for i in (0, -1)]
        if not ends or min(ends) == max(ends):
            return None  # one priority for all (both queues are in priority order)
        first = (s.priority for s in (*self.running, *self.waiting) if s.num_output_tokens == 0)
        best = min(first, default=None)
        return best if best is not None and best < max(ends) else None

    def _schedule_running(self, out: SchedulerOutput, budget: int, cap: int | None) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if cap is not None and seq.priority > cap:
                break  # paused, and so are the ones after it
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

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, cap: int | None) -> None:
        config = self.config
        adapters = {s.lora.id for s in self.running if s.lora is not None}
        skipped: list[Sequence] = []
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if cap is not None and seq.priority > cap:
                break
            if len(self.running) >= config.max_num_seqs and not self._make_room(seq, out, cap):
                break
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
            while computed is None and self._make_room(seq, out, cap):
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

    def _make_room(self, seq: Sequence, out: SchedulerOutput, cap: int | None) -> bool:
        """Preempt the worst running sequence if it is paused for `seq` (a worse priority,
        while `cap` pauses it: it has no chunk in this step); False if there is none."""
        if cap is None or not self.running or self.running[-1].priority <= seq.priority:
            return False
        victim = self.running[-1]
        self._preempt(victim)
        out.preempted.append(victim)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and queue it, first of its priority, to be
        recomputed from its tokens."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        i = 0
        while i < len(self.waiting) and self.waiting[i].priority < seq.priority:
            i += 1
        self.waiting.insert(i, seq)
        self.num_preemptions += 1


def _priority(seq: Sequence) -> int:
    return seq.priority
