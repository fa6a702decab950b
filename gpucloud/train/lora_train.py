"""Training LoRA adapters on a frozen base, and writing them in PEFT's format.

`add_lora` freezes every weight of the model and wraps each targeted projection (of every
decoder layer) in a `TrainableLora`: the base output plus `B(A(x)) · alpha / r`, A drawn as
PEFT draws it (uniform ±1/√in), B zero, so training starts from the base model exactly. The
base may be a weight-only int8/int4 layer (QLoRA): it stays quantized; A and B are fp32.

A checkpoint holds the whole model as pre-training's does (it resumes the same way);
`export_adapter` reads only the A and B entries back and writes `adapter_config.json` and
`adapter_model.safetensors`, which PEFT (`PeftModel.from_pretrained`) and `gpucloud serve
--lora-modules` load.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn

from gpucloud.errors import ConfigError, UserError
from gpucloud.models.lora import ATTENTION_MODULES, CONFIG_FILE, WEIGHTS_FILE, module_shapes
from gpucloud.models.spec import ModelSpec
from gpucloud.train.config import LoraConfig, RunConfig


def _parent(module: str) -> str:
    return "self_attn" if module in ATTENTION_MODULES else "mlp"


class TrainableLora(nn.Module):
    """A frozen projection plus a trainable low-rank update."""

    def __init__(self, base: nn.Module, in_f: int, out_f: int, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(in_f, rank, bias=False)
        self.lora_B = nn.Linear(rank, out_f, bias=False)
        self.scaling = alpha / rank
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.enabled:
            return y
        return y + self.lora_B(self.lora_A(x)) * self.scaling


def lora_targets(spec: ModelSpec, lora: LoraConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each targeted projection. Raises ConfigError for a projection
    the model has no plain form of (a mixture of experts' MLP)."""
    shapes = module_shapes(spec)
    missing = [m for m in lora.target_modules if m not in shapes]
    if missing:
        raise ConfigError(f"lora.target_modules: {spec.name} has no {', '.join(missing)} to "
                          f"adapt (it has {', '.join(shapes)})")  # fmt: skip
    return {m: shapes[m] for m in lora.target_modules}


@torch.no_grad()
def add_lora(model: nn.Module, lora: LoraConfig, seed: int) -> None:
    """Freeze `model` and wrap its targeted projections in place (A seeded by `seed`)."""
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        for name, (in_f, out_f) in lora_targets(model.spec, lora).items():
            parent = getattr(layer, _parent(name))
            wrapped = TrainableLora(getattr(parent, name), in_f, out_f, lora.rank, lora.alpha)
            bound = 1 / math.sqrt(in_f)
            wrapped.lora_A.weight.copy_(torch.rand(lora.rank, in_f, generator=gen) * 2 * bound
                                        - bound)  # fmt: skip
            wrapped.lora_B.weight.zero_()
            setattr(parent, name, wrapped)


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Run `model` as its base: the reference of LoRA-DPO."""
    layers = [m for m in model.modules() if isinstance(m, TrainableLora)]
    for m in layers:
        m.enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.enabled = True


def adapter_info(cfg: RunConfig) -> dict:
    """What a checkpoint records so that `export_adapter` can write the PEFT config."""
    lora = cfg.lora
    return {"base": cfg.model.path, "rank": lora.rank, "alpha": lora.alpha,
            "target_modules": list(lora.target_modules),
            "base_quantization": lora.base_quantization}  # fmt: skip


def peft_config(info: dict) -> dict:
    """adapter_config.json as PEFT's `save_pretrained` writes it for plain LoRA."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": info["base"],
        "r": info["rank"],
        "lora_alpha": info["alpha"],
        "lora_dropout": 0.0,
        "target_modules": info["target_modules"],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def lora_entries(spec: ModelSpec, info: dict) -> dict[str, torch.Tensor]:
    """Empty A and B tensors under the model's names (model.layers.N.self_attn.q_proj.lora_A
    .weight ...), shaped for `info`."""
    lora = LoraConfig(rank=info["rank"], alpha=info["alpha"], target_modules=info["target_modules"])
    entries = {}
    for i in range(spec.num_hidden_layers):
        for name, (in_f, out_f) in lora_targets(spec, lora).items():
            where = f"model.layers.{i}.{_parent(name)}.{name}"
            entries[f"{where}.lora_A.weight"] = torch.empty(lora.rank, in_f)
            entries[f"{where}.lora_B.weight"] = torch.empty(out_f, lora.rank)
    return entries


def save_adapter(entries: dict[str, torch.Tensor], info: dict, out: Path) -> None:
    """Write a PEFT adapter directory: PEFT's names are the model's under base_model.model."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"base_model.model.{k}": v.detach().float().contiguous() for k, v in entries.items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(peft_config(info), indent=2) + "\n")


def export_adapter(path, extra: dict, out: Path, force: bool = False) -> dict:
    """The adapter of checkpoint `path` (train.json `extra`) → a PEFT directory `out`.
    Returns a summary; raises UserError when `out` is a non-empty dir and not `force`."""
    from gpucloud.train.checkpoint import reader

    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"{out} is not empty: choose a new --out or pass --force")
    info = extra["adapter"]
    spec = ModelSpec.from_hf_config(extra["model_config"], name=out.name)
    state = {"model": lora_entries(spec, info)}
    with warnings.catch_warnings():  # DCP warns that no process group exists: none is needed
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader(path), no_dist=True)
    save_adapter(state["model"], info, out)
    return {
        "checkpoint": str(path),
        "step": extra["step"],
        "out": str(out),
        "params": sum(t.numel() for t in state["model"].values()),
        "dtype": "float32",
        "adapter": peft_config(info),
    }
