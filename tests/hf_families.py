"""Tiny random models of every supported family, built with transformers' own classes and
saved by its `save_pretrained`, so config.json is written by transformers (5.x writes
`rope_parameters`), never by us. `legacy_copy` rewrites such a directory in the dialect
transformers 4 wrote (top-level `rope_theta` / `rope_scaling`, no `layer_types`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

VOCAB = 256
_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.1, bos_token_id=1, eos_token_id=2)  # fmt: skip


@dataclass(frozen=True)
class Row:
    """One row of the README's supported-models table, as a tiny model."""

    name: str
    config_class: str  # transformers' config class
    model_class: str
    kwargs: dict = field(default_factory=dict)


def _llama3_rope(theta: float = 500000.0) -> dict:
    return {"rope_type": "llama3", "rope_theta": theta, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip


ROWS = [
    Row("llama-2", "LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {"rope_theta": 1e4}}),
    Row("llama-3", "LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {"rope_theta": 5e5}}),
    Row("llama-3.1", "LlamaConfig", "LlamaForCausalLM", {"rope_parameters": _llama3_rope()}),
    Row("llama-3.2-tied", "LlamaConfig", "LlamaForCausalLM",
        {"rope_parameters": _llama3_rope(), "tie_word_embeddings": True}),
    Row("llama-linear-bias-head_dim", "LlamaConfig", "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
         "attention_bias": True, "head_dim": 32}),
    Row("llama-dynamic", "LlamaConfig", "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}),
    Row("mistral-sliding", "MistralConfig", "MistralForCausalLM",
        {"sliding_window": 16, "head_dim": 24, "rope_parameters": {"rope_theta": 1e6}}),
    Row("qwen2-tied", "Qwen2Config", "Qwen2ForCausalLM",
        {"rope_parameters": {"rope_theta": 1e6}, "tie_word_embeddings": True}),
    Row("qwen2.5-yarn", "Qwen2Config", "Qwen2ForCausalLM",
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                             "original_max_position_embeddings": 64}}),
    Row("qwen2-sliding-layers", "Qwen2Config", "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),
    Row("qwen3-head_dim-tied", "Qwen3Config", "Qwen3ForCausalLM",
        {"head_dim": 32, "rope_parameters": {"rope_theta": 1e6}, "tie_word_embeddings": True}),
    Row("mixtral-moe", "MixtralConfig", "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "rope_parameters": {"rope_theta": 1e6}}),
]  # fmt: skip


def build(row: Row, out: Path, seed: int = 0, vocab: int = VOCAB):
    """transformers' model of `row` with random weights (fp32), saved to `out`; returned in
    eval mode."""
    import transformers

    torch.manual_seed(seed)
    kwargs = _SHAPE | {"vocab_size": vocab} | row.kwargs
    config = getattr(transformers, row.config_class)(**kwargs)
    config._experts_implementation = "eager"  # the grouped-matmul default refuses float64
    model = getattr(transformers, row.model_class)(config).eval()
    model.save_pretrained(out)
    return model


def legacy_copy(model_dir: Path, out: Path) -> Path:
    """`model_dir` with config.json in transformers 4's dialect."""
    shutil.copytree(model_dir, out)
    cfg = json.loads((model_dir / "config.json").read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type", "default")
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    cfg.pop("layer_types", None)  # Qwen2 then derives them from max_window_layers
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


@torch.inference_mode()
def hf_generate(hf, prompts: list[list[int]], new_tokens: int):
    """Greedy tokens and the log-softmax of each step's logits, per prompt."""
    outs = []
    for p in prompts:
        gen = hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)  # fmt: skip
        logprobs = torch.cat(gen.logits).double().log_softmax(-1)
        outs.append((gen.sequences[0, len(p) :].tolist(), logprobs))
    return outs
