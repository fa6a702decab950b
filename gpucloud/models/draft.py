"""Draft models for speculative decoding: a small model of the target's family.

`make_draft_dir` cuts a model directory down to its first layers: embeddings, final norm,
LM head and layers 0..n-1 are the target's own, so the draft shares the tokenizer by
construction and, since each layer only adds to the residual stream, often agrees with
the target on the next token (a stand-in for a distilled draft such as Llama 3.2 1B
drafting for Llama 3.1 8B). `check_draft` refuses a draft that cannot propose tokens of
the target's vocabulary.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from gpucloud.errors import ConfigError
from gpucloud.models.llama import LlamaForCausalLM
from gpucloud.models.loader import load_model, save_model


def make_draft_dir(target_dir: str | Path, out_dir: str | Path, num_layers: int = 1) -> Path:
    """Write a draft model made of the first `num_layers` layers of the model in
    `target_dir` (with its tokenizer) to `out_dir`; returns out_dir. Raises ConfigError when
    the target has no more layers than that."""
    draft = first_layers(load_model(target_dir), num_layers)
    return save_model(draft, out_dir, tokenizer_dir=target_dir)


def first_layers(target: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """A model made of `target`'s first `num_layers` layers (sharing its tensors), with
    its embeddings, final norm and LM head. Raises ConfigError unless the target has more
    layers than that."""
    spec = target.spec
    if not 1 <= num_layers < spec.num_hidden_layers:
        raise ConfigError(f"a draft of {spec.name} needs 1 to {spec.num_hidden_layers - 1} "
                          f"layers, not {num_layers}")  # fmt: skip
    with torch.device("meta"):
        draft = LlamaForCausalLM(replace(spec, num_hidden_layers=num_layers,
                                         layer_types=spec.layer_types[:num_layers]))  # fmt: skip
    kept = {k: v for k, v in target.state_dict().items() if _layer(k) < num_layers}
    draft.load_state_dict(kept, assign=True)
    return draft.eval()


def check_draft(target: LlamaForCausalLM, draft: LlamaForCausalLM, vocab=None, draft_vocab=None):
    """Raise ConfigError unless `draft` can draft for `target`: the same vocabulary size and,
    when given (token -> id maps of their tokenizers), the same vocabulary."""
    t, d = target.spec, draft.spec
    if t.vocab_size != d.vocab_size:
        raise ConfigError(f"draft model {d.name} has a vocabulary of {d.vocab_size} tokens, "
                          f"the target {t.name} {t.vocab_size}: use a draft of the same "
                          "family")  # fmt: skip
    if vocab is not None and draft_vocab is not None and vocab != draft_vocab:
        raise ConfigError(f"draft model {d.name} has another tokenizer than {t.name}: use a "
                          "draft of the same family (same tokenizer.json vocabulary)")  # fmt: skip


def _layer(key: str) -> int:
    """The layer index of a weight name, -1 for weights outside the layers."""
    parts = key.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else -1
