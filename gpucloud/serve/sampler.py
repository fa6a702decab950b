"""Logits → tokens for a batch of sequences with per-sequence `SamplingParams`.

Rows of structured-output sequences first lose every token their grammar forbids
(`structured.py`). Greedy rows take the argmax. Sampled rows go through penalties,
temperature, top-k, top-p and min-p, then draw with the exponential race (argmax of
p / Exp(1) noise), which samples from p exactly and lets a seeded sequence draw its noise
from its own generator: its tokens do not depend on what else is in the batch. Logprobs
are those of the model's raw distribution, before any processing, as OpenAI reports them.
"""

from __future__ import annotations

import torch

from gpucloud.hal import ops
from gpucloud.serve.logprobs import token_logprobs
from gpucloud.serve.sequence import Sequence
from gpucloud.serve.structured import mask_disallowed


class Sampler:
    def __init__(self, eos_token_ids: set[int]):
        self.eos_token_ids = eos_token_ids
        self._filter = ops.get("top_k_top_p")

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Draw one token per row; records logprobs on the sequences that ask for them."""
        raw = logits
        logits = mask_disallowed(raw, [s.grammar for s in seqs])
        if all(s.params.greedy and not self._processed(s) for s in seqs):
            tokens = logits.argmax(-1)
        else:
            tokens = self._sample(logits.clone() if logits is raw else logits, seqs)
        token_list = tokens.tolist()
        wants = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if wants:
            self._record_logprobs(raw, tokens, seqs, wants)
        return token_list

    def logprobs_of(self, logits: torch.Tensor, tokens: list[int], seq: Sequence) -> list:
        """Logprob entries of `tokens`, one per row of `logits`, if the sequence asks for
        them (else [])."""
        if seq.params.logprobs is None:
            return []
        ids = torch.tensor(tokens, device=logits.device)
        return token_logprobs(logits[: len(tokens)], ids, [seq.params.logprobs] * len(tokens))

    def _processed(self, seq: Sequence) -> bool:
        p = seq.params
        return p.has_penalties or seq.num_output_tokens < p.min_tokens

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        for i, seq in enumerate(seqs):
            if seq.params.has_penalties:
                _apply_penalties(logits[i], seq)
            if seq.num_output_tokens < seq.params.min_tokens:
                # a stop id beyond the vocabulary can never be drawn: nothing to ban
                stops = self.eos_token_ids | set(seq.params.stop_token_ids)
                logits[i, [t for t in stops if t < logits.shape[-1]]] = float("-inf")
        greedy = torch.tensor([s.params.greedy for s in seqs], device=logits.device)
        temps = torch.tensor(
            [s.params.temperature or 1.0 for s in seqs], device=logits.device, dtype=logits.dtype
        )
        logits = logits / temps[:, None]
        if any(s.params.needs_filtering for s in seqs):
            logits = self._filter(logits, *_filter_params(logits, seqs))
        probs = logits.softmax(-1)
        noise = torch.empty_like(probs).exponential_()
        for i, seq in enumerate(seqs):
            if seq.params.seed is not None:
                if seq.generator is None:
                    seq.generator = torch.Generator(probs.device).manual_seed(
                        seq.params.seed + seq.index
                    )
                noise[i].exponential_(generator=seq.generator)
        sampled = (probs / noise).argmax(-1)
        return torch.where(greedy, logits.argmax(-1), sampled)

    def _record_logprobs(self, raw, tokens, seqs, rows) -> None:
        top_ns = [seqs[i].params.logprobs for i in rows]
        for i, entry in zip(rows, token_logprobs(raw[rows], tokens[rows], top_ns), strict=True):
            seqs[i].logprobs.append(entry)


def _apply_penalties(row: torch.Tensor, seq: Sequence) -> None:
    """In place on one row of logits. Repetition (CTRL-style) covers prompt and output;
    presence and frequency (OpenAI) cover the output only."""
    p = seq.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), device=row.device)
        values = row[seen]
        row[seen] = torch.where(
            values > 0, values / p.repetition_penalty, values * p.repetition_penalty
        )
    if seq.output_counts and (p.presence_penalty or p.frequency_penalty):
        ids = torch.tensor(list(seq.output_counts), device=row.device)
        counts = torch.tensor(list(seq.output_counts.values()), device=row.device, dtype=row.dtype)
        row[ids] -= p.frequency_penalty * counts + p.presence_penalty


def _filter_params(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, ...]:
    """Each row's top-k (off = the vocabulary), top-p and min-p, for the top_k_top_p op."""
    vocab, dev, dt = logits.shape[-1], logits.device, logits.dtype
    top_k = torch.tensor(
        [s.params.top_k if s.params.top_k > 0 else vocab for s in seqs], device=dev
    )
    top_p = torch.tensor([s.params.top_p for s in seqs], device=dev, dtype=dt)
    min_p = torch.tensor([s.params.min_p for s in seqs], device=dev, dtype=dt)
    return top_k, top_p, min_p
