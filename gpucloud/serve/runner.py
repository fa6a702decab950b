"""The model runner: the one place where a step's bookkeeping becomes tensors.

A step is one forward pass over a flattened batch: the decode tokens of running sequences
first (one each), then prefill chunks. Each layer writes the step's K/V into the paged
cache and attends through block tables (the hal paged-attention ops). Logits are computed
only for the rows that sample a token and, for requests that ask for prompt logprobs, the
rows that score a prompt token (a slice at a time, so a long prompt never holds
[prompt, vocab] logits at once). A chunk that carries a speculative draft runs like a
prefill chunk, and every one of its rows gets logits, to verify the draft. With LoRA
adapters, each row carries its sequence's adapter (none for the base model) into the forward,
so one step mixes adapters.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

import torch

from gpucloud.hal import device as hal_device
from gpucloud.hal import ops
from gpucloud.models.llama import LlamaForCausalLM
from gpucloud.models.spec import ModelSpec
from gpucloud.serve.config import EngineConfig
from gpucloud.serve.logprobs import token_logprobs
from gpucloud.serve.lora import LoraManager
from gpucloud.serve.scheduler import Chunk
from gpucloud.serve.sequence import Logprob, Sequence

SCORE_ROWS = 256  # prompt-scoring rows whose logits exist at once


def kv_bytes_per_token(spec: ModelSpec, dtype: torch.dtype) -> int:
    """K and V of every layer for one token, in bytes."""
    return 2 * spec.num_hidden_layers * spec.kv_size * torch.empty((), dtype=dtype).element_size()


@dataclass(slots=True)
class _Prefill:
    offset: int  # first row of the chunk in the flattened batch
    num_tokens: int
    start: int  # position of the chunk's first token in its sequence
    block_table: torch.Tensor | None  # blocks covering 0..start+num_tokens (None if start == 0)


@dataclass(slots=True)
class _Scored:
    """Rows of the flattened batch whose logits score the next prompt tokens of `seq`."""

    seq: Sequence
    rows: list[int]
    targets: list[int]  # the prompt token each row scores (the one after its position)


@dataclass(slots=True)
class Verification:
    """The target's logits at a decoding sequence's last token and at each draft token."""

    seq: Sequence
    draft: list[int]
    logits: torch.Tensor  # fp32 [len(draft) + 1, vocab]


@dataclass(slots=True)
class StepOutput:
    logits: torch.Tensor  # fp32 [samples, vocab]
    sample_seqs: list[Sequence]  # row by row, the sequences the logits belong to
    prompt_logprobs: list[tuple[Sequence, list[Logprob]]]  # new entries, in prompt order
    verifications: list[Verification]


@dataclass(slots=True)
class _StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    num_decodes: int
    block_tables: torch.Tensor | None  # [decodes, max_blocks]
    context_lens: torch.Tensor | None  # [decodes]
    prefills: list[_Prefill]
    sample_rows: torch.Tensor  # the sampling rows, then every row of the draft chunks
    sample_seqs: list[Sequence]
    drafted: list[Chunk]
    scored: list[_Scored]
    row_adapters: list  # per row, its LoraAdapter or None (empty without LoRA)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: EngineConfig,
        num_blocks: int,
        lora: LoraManager | None = None,
    ):
        spec = model.spec
        self.model, self.lora = model, lora
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # One allocation for the whole pool: [layers, k|v, kv_heads, blocks, block_size, dim].
        self.cache = torch.zeros(
            spec.num_hidden_layers,
            2,
            spec.num_key_value_heads,
            num_blocks,
            config.block_size,
            spec.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.scale = spec.head_dim**-0.5
        self.windows = [spec.attention_window(i) for i in range(spec.num_hidden_layers)]
        if hal_device.detect().name == "cpu":
            from gpucloud.serve import cpu_kernels

            cpu_kernels.build()  # the registry picks it once built
        if self.device.type == "cpu":
            from gpucloud.serve import cpu_linear

            cpu_linear.pack_linears(model)
        self._write = ops.get("write_kv_cache")
        self._decode = ops.get("paged_attention_decode")
        self._paged_prefill = ops.get("paged_attention_prefill")
        self._prefill = ops.get("prefill_attention")

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> StepOutput:
        """Compute the step's chunks: logits of the rows that sample, and the logprobs of the
        prompt tokens this step scores."""
        inputs = self._prepare(chunks)
        hidden = self._hidden_states(inputs)
        logits = self.model.compute_logits(hidden.index_select(0, inputs.sample_rows)).float()
        scores = self._score_prompts(hidden, inputs.scored) if inputs.scored else []
        at, verifications = len(inputs.sample_seqs), []
        for c in inputs.drafted:
            rows = len(c.draft) + 1
            verifications.append(Verification(c.seq, c.draft, logits[at : at + rows]))
            at += rows
        return StepOutput(logits[: len(inputs.sample_seqs)], inputs.sample_seqs, scores,
                          verifications)  # fmt: skip

    def _hidden_states(self, inputs: _StepInputs) -> torch.Tensor:
        if self.lora is None:
            return self._forward(inputs)
        self.lora.set_batch(inputs.row_adapters, self.device)
        try:
            return self._forward(inputs)
        finally:
            self.lora.clear_batch()  # a forward outside the runner sees no adapter

    def _forward(self, inputs: _StepInputs) -> torch.Tensor:
        """The model's forward over the step (its adapters, if any, already set)."""
        return self.model.hidden_states(inputs.input_ids, inputs.positions,
                                        self._attention(inputs))  # fmt: skip

    def _score_prompts(self, hidden: torch.Tensor, scored: list[_Scored]):
        rows = [r for s in scored for r in s.rows]
        targets = [t for s in scored for t in s.targets]
        top_ns = [s.seq.params.prompt_logprobs for s in scored for _ in s.rows]
        entries: list[Logprob] = []
        for i in range(0, len(rows), SCORE_ROWS):
            part = slice(i, i + SCORE_ROWS)
            logits = self.model.compute_logits(hidden.index_select(0, self._tensor(rows[part])))
            entries += token_logprobs(logits, self._tensor(targets[part]), top_ns[part])
        out, at = [], 0
        for s in scored:
            out.append((s.seq, entries[at : at + len(s.rows)]))
            at += len(s.rows)
        return out

    def _attention(self, inputs: _StepInputs):
        cache, scale, b = self.cache, self.scale, inputs.num_decodes

        def attention(q, k, v, layer_index):
            k_cache, v_cache = cache[layer_index]
            window = self.windows[layer_index]
            self._write(k, v, k_cache, v_cache, inputs.slots)
            outs = []
            if b:
                outs.append(
                    self._decode(
                        q[:b],
                        k_cache,
                        v_cache,
                        inputs.block_tables,
                        inputs.context_lens,
                        scale,
                        window,
                    )  # fmt: skip
                )
            for p in inputs.prefills:
                rows = slice(p.offset, p.offset + p.num_tokens)
                if p.block_table is None:
                    outs.append(self._prefill(q[rows], k[rows], v[rows], scale, window))
                else:
                    outs.append(
                        self._paged_prefill(
                            q[rows], k_cache, v_cache, p.block_table, p.start, scale, window
                        )
                    )
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        return attention

    def _prepare(self, chunks: list[Chunk]) -> _StepInputs:
        bs = self.block_size
        decodes = [c for c in chunks if c.num_rows == 1]
        prefills = [c for c in chunks if c.num_rows > 1]
        ids, positions, slots, tables, lengths = [], [], [], [], []
        sample_rows, sample_seqs, scored = [], [], []
        for row, c in enumerate(decodes):
            seq, p = c.seq, c.start
            ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            tables.append(seq.block_table[: p // bs + 1])
            lengths.append(p + 1)
            if c.samples:
                sample_rows.append(row)
                sample_seqs.append(seq)
            _add_scored(scored, c, row)
        offset = len(decodes)
        meta = []
        draft_rows = []
        for c in prefills:
            seq, start, n = c.seq, c.start, c.num_rows
            ids.extend(c.input_ids)
            positions.extend(range(start, start + n))
            table = seq.block_table[: self._blocks(start + n)]
            slots.extend(_slots(table, start, n, bs))
            block_table = None if start == 0 else self._tensor(table)
            meta.append(_Prefill(offset, n, start, block_table))
            _add_scored(scored, c, offset)
            if c.draft:
                draft_rows.extend(range(offset + c.num_tokens - 1, offset + n))
            elif c.samples:
                sample_rows.append(offset + n - 1)
                sample_seqs.append(seq)
            offset += n
        block_tables = context_lens = None
        if decodes:
            width = max(len(t) for t in tables)
            block_tables = self._tensor([t + [0] * (width - len(t)) for t in tables])
            context_lens = self._tensor(lengths)
        return _StepInputs(
            self._tensor(ids),
            self._tensor(positions),
            self._tensor(slots),
            len(decodes),
            block_tables,
            context_lens,
            meta,
            self._tensor(sample_rows + draft_rows),
            sample_seqs,
            [c for c in prefills if c.draft],
            scored,
            self._row_adapters(decodes, prefills),
        )

    def _row_adapters(self, decodes: list[Chunk], prefills: list[Chunk]) -> list:
        if self.lora is None:
            return []
        return [c.seq.lora for c in decodes] + [c.seq.lora for c in prefills
                                                for _ in range(c.num_rows)]  # fmt: skip

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _add_scored(scored: list[_Scored], c: Chunk, first_row: int) -> None:
    """The chunk's rows that score prompt tokens still lacking a logprob (the row at position
    p scores token p + 1). A sequence that needs them computes its prompt from position 0
    (no prefix-cache reuse), so its chunks never skip past a missing entry."""
    seq = c.seq
    if not seq.needs_prompt_logprobs:
        return
    first = max(c.start, len(seq.prompt_logprobs) - 1)
    positions = range(first, min(c.start + c.num_tokens, seq.num_prompt_tokens - 1))
    if positions:
        rows = [first_row + p - c.start for p in positions]
        scored.append(_Scored(seq, rows, [seq.token_ids[p + 1] for p in positions]))


def _slots(table: list[int], start: int, n: int, bs: int) -> list[int]:
    """Flat cache slots of positions start..start+n-1, block by block."""
    out: list[int] = []
    pos, end = start, start + n
    while pos < end:
        block, offset = divmod(pos, bs)
        take = min(bs - offset, end - pos)
        base = table[block] * bs + offset
        out.extend(range(base, base + take))
        pos += take
    return out


def profile_kv_cache_bytes(model: LlamaForCausalLM, config: EngineConfig, max_model_len: int):
    """KV pool size from memory: a fraction of free device memory, minus the activation peak
    of a full-budget forward pass, and no more than `max_num_seqs` full-length sequences use.
    """
    spec, param = model.spec, next(model.parameters())
    backend = hal_device.detect()
    tokens = min(config.max_num_batched_tokens, max_model_len)
    ids = torch.zeros(1, tokens, dtype=torch.long, device=param.device)
    before = _peak_bytes(backend)
    with torch.inference_mode():
        model.hidden_states(ids)
    activation_peak = max(_peak_bytes(backend) - before, 0)
    free = hal_device.memory_info(backend=backend).free_bytes or 0
    budget = int(free * config.kv_cache_memory_fraction) - activation_peak
    per_token = kv_bytes_per_token(spec, param.dtype)
    useful = config.max_num_seqs * max_model_len * per_token
    return max(min(budget, useful), 0)


def _peak_bytes(backend) -> int:
    if backend.name == "cpu":  # the process's resident high-water mark (KiB on Linux)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return getattr(torch, backend.name).max_memory_allocated()
