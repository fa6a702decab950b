"""What one training step optimizes, chosen by `recipe.kind`: a batch source and a loss.

The trainer asks a recipe for the micro-batch of samples [first, first + count) (a pure
function of the data seed, so resume reads what the first attempt read) and for the loss of
the module on it; everything else (strategies, accumulation, health, checkpoints) is the
same for every recipe.

- pretrain: windows of a prepared dataset, next-token loss on every token;
- sft: chat conversations, next-token loss on assistant tokens only (the mean over the
  micro-batch's trained tokens), packed rows attending within each conversation;
- dpo: preference pairs, the DPO loss against the start model.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from gpucloud.hal import ops
from gpucloud.train.config import RunConfig
from gpucloud.train.data import DatasetInfo, TokenWindows, read_info
from gpucloud.train.parallel import loss_fn

Batch = dict[str, torch.Tensor]


class Recipe(Protocol):
    tokenizer_dir: str | None
    """The tokenizer an exported model ships with."""

    def batch(self, first_sample: int, count: int) -> Batch: ...

    def loss(self, module: nn.Module, batch: Batch) -> torch.Tensor: ...


class Pretrain:
    def __init__(self, cfg: RunConfig):
        self.info: DatasetInfo = read_info(cfg.data.path)
        self.windows = TokenWindows(self.info, cfg.data.seq_len, cfg.data.seed)
        self.tokenizer_dir = self.info.tokenizer

    def batch(self, first_sample: int, count: int) -> Batch:
        """{"tokens": [count, seq_len + 1]}: inputs are all but the last, targets all but
        the first."""
        return {"tokens": torch.from_numpy(self.windows.batch(first_sample, count))}

    def loss(self, module: nn.Module, batch: Batch) -> torch.Tensor:
        tokens = batch["tokens"]
        return loss_fn(module(tokens[:, :-1]), tokens[:, 1:])


class Sft:
    def __init__(self, cfg: RunConfig):
        from gpucloud.train.chat_data import (
            Rows,
            chat_tokenizer,
            pack_rows,
            piece,
            read_conversations,
        )

        tok = chat_tokenizer(cfg.model.path)
        seq_len = cfg.data.seq_len
        pieces = [piece(e, seq_len, f"{cfg.data.path} conversation {i + 1}")
                  for i, e in enumerate(read_conversations(cfg.data.path, tok))]  # fmt: skip
        self.packing = cfg.recipe.packing
        arrays = pack_rows(pieces, seq_len, _pad_id(tok), self.packing, cfg.data.seed)
        self.rows = Rows(arrays, cfg.data.seed)
        self.tokenizer_dir = cfg.model.path
        self._attention = ops.get("document_attention")

    def batch(self, first_sample: int, count: int) -> Batch:
        """[count, seq_len] inputs, targets (-100: not trained), positions, documents."""
        return self.rows.batch(first_sample, count)

    def loss(self, module: nn.Module, batch: Batch) -> torch.Tensor:
        if not self.packing:  # one conversation per row, padded at its end: plain causal
            return loss_fn(module(batch["inputs"]), batch["targets"])
        documents = batch["documents"]

        def attention(q, k, v, layer_index: int) -> torch.Tensor:  # noqa: ARG001 - Attention
            return self._attention(q, k, v, documents)

        return loss_fn(module(batch["inputs"], batch["positions"], attention), batch["targets"])


class Dpo:
    def __init__(self, cfg: RunConfig, model: nn.Module):
        from gpucloud.train.chat_data import Rows, chat_tokenizer
        from gpucloud.train.dpo import DpoLoss, read_pairs

        tok = chat_tokenizer(cfg.model.path)
        self.rows = Rows(read_pairs(cfg.data.path, tok, cfg.data.seq_len, _pad_id(tok)),
                         cfg.data.seed)  # fmt: skip
        self.dpo = DpoLoss(model, cfg.recipe.beta, lora=cfg.lora is not None)
        self.tokenizer_dir = cfg.model.path

    def batch(self, first_sample: int, count: int) -> Batch:
        """[count, 2, seq_len] inputs and targets of `count` pairs (chosen, rejected)."""
        return self.rows.batch(first_sample, count)

    def loss(self, module: nn.Module, batch: Batch) -> torch.Tensor:
        return self.dpo(module, batch)


def _pad_id(tok) -> int:
    return tok.pad_id if tok.pad_id is not None else (tok.eos_id or 0)


def build(cfg: RunConfig, model: nn.Module) -> Recipe:
    """The recipe of `cfg` for `model` (on its device, before any parallel wrapping: DPO
    copies it as the reference). Raises ConfigError for unreadable data."""
    kind = cfg.recipe.kind
    if kind == "sft":
        return Sft(cfg)
    if kind == "dpo":
        return Dpo(cfg, model)
    return Pretrain(cfg)


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device) for k, v in batch.items()}
