"""Rotary position embeddings: the inverse frequencies of every RoPE type the supported
families use, and the factor cos/sin are scaled by (YaRN's attention factor, else 1).

The arithmetic follows transformers' order of operations in fp32, so a model loaded here
rotates by bit-identical angles and its logits match to the last bits at fp64.
"""

from __future__ import annotations

import math

import torch

from gpucloud.errors import ConfigError
from gpucloud.models.spec import ModelSpec

TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_parameters(spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] in fp32 on CPU, attention factor) of `spec`'s RoPE.

    Raises ConfigError for a RoPE type that is not implemented here.
    """
    scaling = spec.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return _inv_freq(spec.rope_theta, spec.head_dim), 1.0
    if kind == "linear":
        return _inv_freq(spec.rope_theta, spec.head_dim) / scaling["factor"], 1.0
    if kind == "dynamic":
        return _dynamic(spec, scaling), 1.0
    if kind == "llama3":
        return _llama3(_inv_freq(spec.rope_theta, spec.head_dim), scaling, spec), 1.0
    if kind == "yarn":
        return _yarn(spec, scaling)
    raise ConfigError(f"{spec.name}: rope_type {kind!r} is not supported: use one of "
                      f"{', '.join(TYPES)}")  # fmt: skip


def _exponents(dim: int) -> torch.Tensor:
    # Always on CPU: a model built under `torch.device("meta")` still gets real frequencies,
    # and the meta kernel of `scalar ** tensor` would import torch._dynamo (seconds).
    return torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim


def _inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** _exponents(dim))


def _dynamic(spec: ModelSpec, s: dict) -> torch.Tensor:
    """Dynamic NTK: the base grows with the sequence length L past max_position_embeddings,
    θ' = θ · (factor · L / max_pos − (factor − 1)) ^ (dim / (dim − 2)). The engine and the
    trainer never run past max_position_embeddings, where L counts as max_pos (as in
    transformers) and θ' = θ; the formula stays so the number is computed, not assumed."""
    dim, max_pos, factor = spec.head_dim, spec.max_position_embeddings, s["factor"]
    seq_len = max_pos
    theta = spec.rope_theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _inv_freq(theta, dim)


def _llama3(inv_freq: torch.Tensor, s: dict, spec: ModelSpec) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s.get("original_max_position_embeddings", spec.max_position_embeddings)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(spec: ModelSpec, s: dict) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate (divide by `factor`) the dimensions that turn fewer than `beta_slow`
    times over the original context, keep those turning more than `beta_fast` times, ramp
    linearly between; cos/sin are scaled by the attention factor (0.1·ln(factor) + 1)."""
    dim, theta = spec.head_dim, spec.rope_theta
    old_len = s.get("original_max_position_embeddings", spec.max_position_embeddings)
    factor = s.get("factor") or spec.max_position_embeddings / old_len
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    wavelength = theta ** _exponents(dim)
    inv_freq = (1.0 / (factor * wavelength)) * (1 - keep) + (1.0 / wavelength) * keep
    return inv_freq, _yarn_attention_factor(s, factor)


def _yarn_attention_factor(s: dict, factor: float) -> float:
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
    return mscale(factor)
