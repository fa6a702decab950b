"""Direct preference optimization on preference pairs.

A line is `{"prompt", "chosen", "rejected"}`: the prompt a string (one user message) or a
list of messages, each answer a string (one assistant message) or a list of messages. Both
conversations are rendered with the chat template; only the answer's assistant tokens count.

The loss of a pair is -log σ(β · margin), margin = (log π(chosen) - log π_ref(chosen)) -
(log π(rejected) - log π_ref(rejected)), each log-probability summed over the answer's
tokens. The reference is the model as training started: a frozen copy of it, or, when only
LoRA adapters train, the same model with its adapters off.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gpucloud.errors import ConfigError
from gpucloud.models.tokenizer import Tokenizer
from gpucloud.train.chat_data import (
    IGNORE,
    encode_at,
    messages_of,
    pack_rows,
    piece,
    read_jsonl,
)


def read_pairs(path, tok: Tokenizer, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """[pairs, 2, seq_len] inputs and targets (chosen first). Raises ConfigError."""

    def parse(obj: dict, where: str) -> list[dict[str, np.ndarray]]:
        prompt = _side(obj, "prompt", "user", where)
        return [piece(encode_at(tok, prompt + _side(obj, key, "assistant", where), len(prompt),
                               where), seq_len, where)
                for key in ("chosen", "rejected")]  # fmt: skip

    pairs = read_jsonl(path, parse)
    rows = pack_rows([p for pair in pairs for p in pair], seq_len, pad_id, packing=False, seed=0)
    return {k: rows[k].reshape(len(pairs), 2, seq_len) for k in ("inputs", "targets")}


def _side(obj: dict, key: str, role: str, where: str) -> list[dict]:
    value = obj.get(key)
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if value is None:
        raise ConfigError(f'{where}: a preference pair has "prompt", "chosen" and "rejected"')
    return messages_of(value, where, key)


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per row, the summed log-probability of its trained targets (fp32)."""
    logps = torch.log_softmax(logits.float(), dim=-1)
    mask = targets != IGNORE
    picked = logps.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1)


class DpoLoss:
    """The recipe's loss: policy and reference log-probabilities of a batch of pairs."""

    def __init__(self, model: nn.Module, beta: float, lora: bool):
        self.beta = beta
        if lora:
            from gpucloud.train.lora_train import adapters_off

            self.reference: nn.Module = model
            self.reference_mode: Callable = lambda: adapters_off(model)
        else:
            self.reference = copy.deepcopy(model).requires_grad_(False).eval()
            self.reference_mode = contextlib.nullcontext

    def margins(self, module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per pair: (policy - reference) log-prob of chosen minus that of rejected."""
        inputs, targets = (_flat(batch[k]) for k in ("inputs", "targets"))
        policy = sequence_logps(module(inputs), targets)
        with torch.no_grad(), self.reference_mode():
            reference = sequence_logps(self.reference(inputs), targets)
        chosen, rejected = (policy - reference).view(2, -1)
        return chosen - rejected

    def __call__(self, module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return -F.logsigmoid(self.beta * self.margins(module, batch)).mean()


def _flat(pairs: torch.Tensor) -> torch.Tensor:
    """[pairs, 2, seq] → [2·pairs, seq]: every chosen row, then every rejected row."""
    return pairs.transpose(0, 1).reshape(-1, pairs.shape[-1])
