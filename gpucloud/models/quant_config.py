"""Which weight-only quantization a model's linear layers use, and where it comes from.

Either the user asks for it (`--quantization int8|int4`: fp weights quantized at load), or
the checkpoint is already quantized: its config.json carries a `quantization_config` as
GPTQ and AWQ tools write it. Anything else there (another method, other bit widths, AWQ's
GEMV packing) is a ConfigError naming the key: a model that loads computes what its
checkpoint means, or does not load at all.

Torch-free: the planner and the control plane read configs too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpucloud.errors import ConfigError

METHODS = ("int8", "int4")  # what --quantization takes
CHECKPOINTS = ("fp", "gptq", "gptq_v2", "awq")  # fp: quantized at load
DEFAULT_GROUP_SIZE = 128


@dataclass(frozen=True)
class Quantization:
    """int8: symmetric, one scale per output channel. int4: asymmetric, a scale and a 4-bit
    zero point per group of `group_size` input channels (-1: one group per row)."""

    method: str  # int8 | int4
    group_size: int = DEFAULT_GROUP_SIZE  # int4 only
    checkpoint: str = "fp"  # how the weights are stored: fp | gptq | gptq_v2 | awq
    act_order: bool = False  # GPTQ desc_act: g_idx assigns input channels to groups

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(
                f"quantization {self.method!r} is not supported: use {' or '.join(METHODS)}"
            )
        if self.checkpoint not in CHECKPOINTS:
            raise ConfigError(f"quantized checkpoint format {self.checkpoint!r} is not supported")
        if self.group_size != -1 and self.group_size < 1:
            raise ConfigError(f"group_size must be positive or -1, got {self.group_size}")

    def group(self, in_features: int) -> int:
        """Input channels per group of a layer with `in_features` inputs."""
        if self.group_size == -1:
            return in_features
        return min(self.group_size, in_features)


def from_hf(cfg: dict[str, Any], name: str) -> Quantization:
    """The quantization of a config.json's `quantization_config`. Raises ConfigError for a
    method, bit width or packing this runtime does not read."""
    method = cfg.get("quant_method")
    if method not in ("gptq", "awq"):
        raise ConfigError(
            f"{name}: quantization_config.quant_method {method!r} is not supported: gptq or awq "
            "(4-bit), or an unquantized checkpoint served with --quantization int8|int4"
        )
    bits = cfg.get("bits", cfg.get("w_bit"))
    if bits != 4:
        raise ConfigError(
            f"{name}: quantization_config.bits = {bits!r} is not supported: {method} with 4 bits"
        )
    group_size = cfg.get("group_size", cfg.get("q_group_size", DEFAULT_GROUP_SIZE))
    if method == "awq":
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm" or cfg.get("zero_point", True) is not True:
            raise ConfigError(
                f"{name}: AWQ version {version!r} with zero_point {cfg.get('zero_point')!r} is "
                "not supported: version gemm with zero points"
            )
        return Quantization("int4", group_size, "awq")
    fmt = cfg.get("checkpoint_format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise ConfigError(
            f"{name}: GPTQ checkpoint_format {fmt!r} is not supported: gptq or gptq_v2"
        )
    return Quantization("int4", group_size, fmt, act_order=bool(cfg.get("desc_act", False)))


def requested(method: str | None, stored: Quantization | None, name: str) -> Quantization | None:
    """What to serve: the checkpoint's own quantization, or `method` (int8|int4) applied to fp
    weights. Raises ConfigError when `method` asks a quantized checkpoint for another one."""
    if stored is not None:
        if method not in (None, stored.method):
            raise ConfigError(
                f"{name} is a {stored.checkpoint} {stored.method} checkpoint: it cannot be served "
                f"with --quantization {method} (leave it out or give {stored.method})"
            )
        return stored
    return None if method is None else Quantization(method)
