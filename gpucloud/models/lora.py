"""LoRA adapters in PEFT's format, and the decoder layers that apply many of them at once.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` with a
`lora_A` [r, in] and `lora_B` [out, r] pair per adapted projection. `load_adapter` reads and
checks it against the base model: only plain LoRA on the decoder's q/k/v/o and gate/up/down
projections is served (no DoRA, biases, extra trained modules or per-module ranks); anything
else is a ConfigError naming what was found and what is allowed. The scaling (`lora_alpha /
r`, or `/ sqrt(r)` with rsLoRA) is folded into B once, at load.

`LoraLinear` wraps a projection with `slots` resident adapters, padded to one rank: its
output is the base output plus `x @ Aᵀ @ Bᵀ` of each token's adapter (the `lora_add` hal op),
the tokens of one step told apart by a `LoraBatch` that every wrapped layer shares.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from gpucloud.errors import ConfigError
from gpucloud.hal import ops
from gpucloud.models.spec import ModelSpec
from gpucloud.models.tensor_parallel import Shard

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
# adapter_config.json fields that change the math; their "off" values.
_UNSUPPORTED = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "layer_replication": (None,),
    "target_parameters": (None, []),
    "trainable_token_indices": (None,),
    "use_qalora": (False, None),
    "alora_invocation_tokens": (None,),
}

Weights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class LoraAdapter:
    """One adapter: {(layer, module): (A [r, in], B·scaling [out, r])}, on the CPU in fp32.
    `id` is unique per load, so a reloaded adapter never matches the old one's cache."""

    name: str
    path: str
    rank: int
    weights: Weights = field(repr=False)
    id: int = 0


def module_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) features of every projection an adapter may target (the MLP's only on a
    dense model: Mixtral's experts take none)."""
    h, i = spec.hidden_size, spec.intermediate_size
    shapes = {"q_proj": (h, spec.q_size), "k_proj": (h, spec.kv_size),
              "v_proj": (h, spec.kv_size), "o_proj": (spec.q_size, h)}  # fmt: skip
    if not spec.is_moe:
        shapes |= {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    return shapes


def load_adapter(path: str | Path, spec: ModelSpec, max_rank: int, name: str) -> LoraAdapter:
    """The PEFT adapter at `path`, checked against `spec`. Raises ConfigError (one line:
    the adapter, what is wrong, what is allowed)."""
    path = Path(path)
    config = _read_config(path, name)
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise ConfigError(f"LoRA adapter {name!r} has rank {rank}: the server takes ranks 1.."
                          f"{max_rank} (raise --max-lora-rank)")  # fmt: skip
    alpha = rank if alpha is None else alpha
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = _read_weights(path, name, spec, rank)
    return LoraAdapter(name, str(path), rank,
                       {k: (a, b * scaling) for k, (a, b) in weights.items()})  # fmt: skip


def _read_config(path: Path, name: str) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ConfigError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {path} (a PEFT adapter "
                          "directory, as save_pretrained writes it)")  # fmt: skip
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"LoRA adapter {name!r}: cannot read {file}: {e}") from None
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"LoRA adapter {name!r} is of PEFT type {config.get('peft_type')!r}: "
                          "only LORA is served")  # fmt: skip
    for key, off in _UNSUPPORTED.items():
        if config.get(key, off[0]) not in off:
            raise ConfigError(f"LoRA adapter {name!r} sets {key}={config[key]!r}: not supported "
                              f"(served: plain LoRA on {', '.join(TARGET_MODULES)})")  # fmt: skip
    targets = config.get("target_modules")
    # A string is a regex PEFT matched at training time: the weights tell what it matched.
    other = sorted(set(targets) - set(TARGET_MODULES)) if isinstance(targets, list) else []
    if other:
        raise ConfigError(f"LoRA adapter {name!r} targets {', '.join(other)}: LoRA is served on "
                          f"{', '.join(TARGET_MODULES)} only")  # fmt: skip
    return config


def _read_weights(path: Path, name: str, spec: ModelSpec, rank: int) -> Weights:
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise ConfigError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {path} (save it with "
                          "safe_serialization=True)")  # fmt: skip
    shapes = module_shapes(spec)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(file).items():
        m = _KEY.match(key)
        if m is None or m[3] not in shapes or int(m[1]) >= spec.num_hidden_layers:
            raise ConfigError(f"LoRA adapter {name!r} holds {key}: not a projection this model "
                              f"serves LoRA on ({', '.join(shapes)} of its "
                              f"{spec.num_hidden_layers} layers)")  # fmt: skip
        pairs.setdefault((int(m[1]), m[3]), {})[m[4]] = tensor.float()
    if not pairs:
        raise ConfigError(f"LoRA adapter {name!r}: {file} holds no LoRA weights")
    for (layer, module), ab in pairs.items():
        in_f, out_f = shapes[module]
        want = {"A": (rank, in_f), "B": (out_f, rank)}
        for part, shape in want.items():
            got = list(ab[part].shape) if part in ab else "missing"
            if got != list(shape):
                where = f"layers.{layer}.{_parent(module)}.{module}.lora_{part}"
                raise ConfigError(f"LoRA adapter {name!r} does not fit this base model: {where} "
                                  f"is {got}, the model needs {list(shape)}")  # fmt: skip
    return {k: (ab["A"], ab["B"]) for k, ab in pairs.items()}


def _parent(module: str) -> str:
    return "self_attn" if module in ATTENTION_MODULES else "mlp"


# ---- serving many adapters at once -----------------------------------------------------------
@dataclass(slots=True)
class LoraBatch:
    """The current forward's tokens by adapter slot: [(slot, rows)], rows a long tensor of
    token indices in the flattened batch; tokens of no adapter are in no group."""

    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)


class LoraLinear(nn.Module):
    """A projection plus up to `slots` LoRA adapters of rank <= `rank`, zero where unused."""

    def __init__(self, base: nn.Module, in_f: int, out_f: int, slots: int, rank: int,
                 batch: LoraBatch):  # fmt: skip
        super().__init__()
        self.base = base
        # A quantized layer keeps its model dtype in its scales.
        like = base.scales if hasattr(base, "scales") else base.weight
        dtype, device = like.dtype, like.device
        self.register_buffer("lora_a", torch.zeros(slots, rank, in_f, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(slots, out_f, rank, dtype=dtype, device=device))
        self.batch = batch
        self._op = ops.get("lora_add")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.batch.groups:
            self._op(y, x, self.lora_a, self.lora_b, self.batch.groups)
        return y

    def load_slot(self, slot: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put an adapter's (A, B) in `slot`, or zeros when it does not adapt this layer."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if pair is not None:
            a, b = pair
            self.lora_a[slot, : a.shape[0]] = a
            self.lora_b[slot, :, : b.shape[1]] = b


def load_slot(
    layers: dict[tuple[int, str], LoraLinear],
    slot: int,
    weights: Weights,
    shard: Shard | None = None,
) -> None:
    """Put an adapter's `weights` in `slot` of every wrapped layer; with `shard`, the
    tensor-parallel rank's part of each pair."""
    for (index, module), layer in layers.items():
        pair = weights.get((index, module))
        if pair is not None and shard is not None:
            pair = shard.lora_pair(module, *pair)
        layer.load_slot(slot, pair)


def install_lora_layers(
    model: nn.Module, slots: int, rank: int
) -> dict[tuple[int, str], LoraLinear]:
    """Wrap every projection an adapter may target in a LoraLinear (in place), sized by
    `model.spec` (a tensor-parallel rank's own shapes on a shard); returns them by (layer,
    module) and leaves the batch they share as `model.lora_batch`."""
    spec: ModelSpec = model.spec
    batch = LoraBatch()
    layers: dict[tuple[int, str], LoraLinear] = {}
    for index, layer in enumerate(model.model.layers):
        for module, (in_f, out_f) in module_shapes(spec).items():
            parent = getattr(layer, _parent(module))
            wrapped = LoraLinear(getattr(parent, module), in_f, out_f, slots, rank, batch)
            setattr(parent, module, wrapped)
            layers[index, module] = wrapped
    model.lora_batch = batch
    return layers
