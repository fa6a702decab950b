"""LoRA adapters for the serve tests, made by PEFT itself on the transformers twin of a model
directory (so adapter_config.json and the weight names are PEFT's, not ours)."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Two adapters unlike each other: every projection at rank 8, and three at rank 4 with rsLoRA.
ADAPTERS = {
    "alpha": {"r": 8, "lora_alpha": 16, "target_modules": ALL_TARGETS},
    "beta": {"r": 4, "lora_alpha": 8, "use_rslora": True,
             "target_modules": ["q_proj", "v_proj", "down_proj"]},
}  # fmt: skip


def hf_model(model_dir: Path, dtype: torch.dtype = torch.float32):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def make_peft_adapter(model_dir: Path, out_dir: Path, seed: int, **lora_config) -> Path:
    """A random PEFT LoRA adapter for `model_dir`, saved to `out_dir`: B is random too
    (PEFT's `init_lora_weights=False`), so the adapter changes the model's output."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, **lora_config)
    peft.get_peft_model(hf_model(model_dir), config).save_pretrained(out_dir)
    return out_dir


def peft_model(model_dir: Path, adapter_dir: Path | None, dtype: torch.dtype):
    """transformers + PEFT: the base model with `adapter_dir` loaded (None: the base alone)."""
    import peft

    base = hf_model(model_dir, dtype)
    if adapter_dir is None:
        return base
    return peft.PeftModel.from_pretrained(base, adapter_dir).eval()
