"""One rank's model under tensor parallelism: its shard of the weights, wired to the group.

Attention and MLP shards end in an all-reduce (`DecoderLayer.reduce`); the embeddings and
the LM head are split by vocabulary rows. The driver's LM head asks the workers to compute
their rows of the same logits, and gathers them: the logits of the rows the engine samples
or scores only, never of the whole batch.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gpucloud.models.llama import LlamaForCausalLM
from gpucloud.models.loader import load_model
from gpucloud.models.tensor_parallel import Shard
from gpucloud.serve.config import EngineConfig
from gpucloud.serve.tp_group import TensorParallelGroup

LOGITS = "logits"  # the message that asks the workers for their rows of the logits


class VocabParallelEmbedding(nn.Module):
    """A rank's rows of the embedding table: other ranks' tokens look up zeros here, which
    the all-reduce fills in."""

    def __init__(self, weight: nn.Parameter, rank: int, group: TensorParallelGroup):
        super().__init__()
        self.weight, self.start, self.group = weight, rank * weight.shape[0], group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


class VocabParallelHead(nn.Module):
    """A rank's rows of the LM head. On the driver, `forward` gives the whole vocabulary's
    logits: it sends the hidden states to the workers, which answer with `gather`."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, group: TensorParallelGroup):
        super().__init__()
        self.weight, self.vocab_size, self.group = weight, vocab_size, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.group.send((LOGITS, hidden))
        return self.gather(hidden)

    def gather(self, hidden: torch.Tensor) -> torch.Tensor:
        parts = self.group.all_gather(F.linear(hidden, self.weight))
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def load_rank(
    model_dir: str | Path, config: EngineConfig, rank: int, size: int, device: torch.device
) -> LlamaForCausalLM:
    """Rank `rank`'s shard of the model, on `device`, not yet wired to a group."""
    shard = Shard(rank, size)
    return load_model(model_dir, config.dtype, device, config.quantization, shard)


def wire(model: LlamaForCausalLM, group: TensorParallelGroup, vocab_size: int) -> None:
    """Make a loaded shard compute with the other ranks. Its `spec` then has the rank's heads
    and MLP columns and the whole vocabulary: the logits it returns are whole."""
    model.model.embed_tokens = VocabParallelEmbedding(
        model.model.embed_tokens.weight, group.rank, group
    )
    # the same Parameter as the embedding's when they are tied
    model.lm_head = VocabParallelHead(model.lm_head.weight, vocab_size, group)
    for layer in model.model.layers:
        layer.reduce = group.all_reduce
    model.spec = replace(model.spec, vocab_size=vocab_size)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the module's weights: parameters and persistent buffers (quantized layers
    keep theirs as buffers), shared ones once."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())
