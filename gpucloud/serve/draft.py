"""Draft-model speculative decoding: a small model of the target's family guesses the next
tokens, the target verifies them in one forward (`speculative.accept`).

The draft has its own KV pool with as many blocks as the target's, addressed through the
target's block tables: a sequence's blocks hold the target's K/V in one pool and the
draft's in the other, so allocation, preemption and the prefix cache need no second
bookkeeping. What the draft has computed is one counter per sequence,
`draft_computed_tokens` (its K/V is valid below it): the scheduler zeroes it when a
sequence (re)starts, and verification lowers it to the confirmed tokens.

The scheduler reserves the draft's rows and blocks as it does for n-gram guesses (the
engine puts placeholders in `draft_token_ids`); once a step is scheduled, `propose` fills
each chunk's draft: one forward catches the draft up on the sequence's tokens and gives
the first guess, then one forward per further guess, batched over the sequences.
"""

from __future__ import annotations

import torch

from gpucloud.models.llama import LlamaForCausalLM
from gpucloud.serve.config import EngineConfig
from gpucloud.serve.runner import ModelRunner
from gpucloud.serve.scheduler import Chunk
from gpucloud.serve.sequence import Sequence

PLACEHOLDER = 0  # a reserved draft row before the draft model has filled it


class DraftModelProposer:
    def __init__(self, model: LlamaForCausalLM, config: EngineConfig, num_blocks: int):
        self.runner = ModelRunner(model, config, num_blocks)

    @torch.inference_mode()
    def propose(self, chunks: list[Chunk]) -> None:
        """Replace the placeholders of each chunk's draft by the draft model's greedy
        guesses, and record the K/V it computed on each sequence."""
        views = [_view(c.seq) for c in chunks]
        step = []
        for c, view in zip(chunks, views, strict=True):
            start = min(c.seq.draft_computed_tokens, c.seq.num_tokens - 1)
            step.append(Chunk(view, start, view.num_tokens - start))
        while step:
            out = self.runner.run(step)
            for view, token in zip(out.sample_seqs, out.logits.argmax(-1).tolist(), strict=True):
                view.token_ids.append(token)
            step = [Chunk(v, v.num_tokens - 1, 1)
                    for c, v in zip(chunks, views, strict=True)
                    if v.num_tokens - c.seq.num_tokens < len(c.draft)]  # fmt: skip
        for c, view in zip(chunks, views, strict=True):
            c.draft = view.token_ids[c.seq.num_tokens :]
            # The last guess was never fed back: K/V exists up to the one before it.
            c.seq.draft_computed_tokens = c.seq.num_tokens + len(c.draft) - 1


def _view(seq: Sequence) -> Sequence:
    """What the draft's runner reads of `seq`: its tokens (to which guesses are appended)
    and its block table, with no logprobs or adapter to compute."""
    return Sequence(seq.request_id, seq.index, seq.params, list(seq.token_ids),
                    seq.num_prompt_tokens, block_table=seq.block_table)  # fmt: skip
