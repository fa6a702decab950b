"""Reading a Hugging Face config.json, in either dialect transformers writes.

transformers 4 wrote top-level `rope_theta` and `rope_scaling`; transformers 5 writes one
`rope_parameters` dict holding `rope_theta`, `rope_type` and the scaling factors. Both read
the same here. A key we do not implement but that changes the model's math (an unknown RoPE
type, a soft-cap, qk-norm on a family without it, ...) is a ConfigError naming the key: a
model that loads computes what transformers computes, or does not load at all.

Torch-free: the planner and the control plane read configs too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpucloud.errors import ConfigError
from gpucloud.models import quant_config


@dataclass(frozen=True)
class Family:
    """What an HF architecture computes, and its config class's defaults for absent keys."""

    qkv_bias: bool | None  # None: the config's `attention_bias` decides
    sliding: str  # "none" | "all" (every layer) | "layers" (use_sliding_window + layer_types)
    qk_norm: bool = False
    moe: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    sliding_window: int | None = None


FAMILIES = {
    "llama": Family(qkv_bias=None, sliding="none"),
    "mistral": Family(qkv_bias=False, sliding="all", sliding_window=4096),
    "mixtral": Family(qkv_bias=False, sliding="all", moe=True, rope_theta=1e6, rms_norm_eps=1e-5),
    "qwen2": Family(qkv_bias=True, sliding="layers"),
    "qwen3": Family(qkv_bias=None, sliding="layers", qk_norm=True, head_dim=128),
}

# Each RoPE type, the keys of its parameters, and those without a default.
ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"},
}  # fmt: skip
_ROPE_REQUIRED = {"linear": {"factor"}, "dynamic": {"factor"},
                  "llama3": {"factor", "low_freq_factor", "high_freq_factor"}}  # fmt: skip
_ROPE_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}

# Keys other architectures use that change the math; none of the supported families has them.
# A switch is off when absent or falsy; a multiplier when absent or 1.
SWITCHES = {
    "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "final logit soft-capping",
    "use_qk_norm": "qk-norm",
    "qk_layernorm": "qk-norm",
    "qk_norm": "qk-norm",
    "attention_chunk_size": "chunked attention",
    "no_rope_layers": "layers without RoPE",
    "mlp_bias": "MLP biases",
}
MULTIPLIERS = {
    "query_pre_attn_scalar": "a custom attention scale",
    "attention_multiplier": "an attention multiplier",
    "embedding_multiplier": "an embedding multiplier",
    "residual_multiplier": "a residual multiplier",
    "logits_scaling": "logit scaling",
    "logit_scale": "logit scaling",
}


def spec_kwargs(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    """ModelSpec's keyword arguments from a config.json dict. Raises ConfigError naming a
    missing key, or a key whose value this runtime does not compute."""
    model_type = cfg.get("model_type", "llama")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ConfigError(
            f"{name}: model_type {model_type!r} is not supported: use one of {', '.join(FAMILIES)}"
        )
    _reject_unsupported(cfg, name)
    try:
        kwargs = {key: cfg[key] for key in ("vocab_size", "hidden_size", "intermediate_size",
                  "num_hidden_layers", "num_attention_heads")}  # fmt: skip
    except KeyError as e:
        raise ConfigError(f"{name}: config.json lacks {e.args[0]!r}") from None
    max_pos = cfg.get("max_position_embeddings", 4096)
    theta, scaling = rope_of(cfg, family, max_pos, name)
    window, layer_types = _windows(cfg, family, kwargs["num_hidden_layers"], name)
    bias = family.qkv_bias if family.qkv_bias is not None else cfg.get("attention_bias", False)
    return kwargs | dict(
        name=name,
        model_type=model_type,
        num_key_value_heads=cfg.get("num_key_value_heads") or kwargs["num_attention_heads"],
        head_dim=cfg.get("head_dim") or family.head_dim,
        max_position_embeddings=max_pos,
        rope_theta=float(theta),
        rope_scaling=scaling,
        rms_norm_eps=cfg.get("rms_norm_eps", family.rms_norm_eps),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=bool(bias),
        qk_norm=family.qk_norm,
        num_local_experts=cfg.get("num_local_experts", 1) if family.moe else 1,
        num_experts_per_tok=cfg.get("num_experts_per_tok", 1) if family.moe else 1,
        sliding_window=window,
        layer_types=layer_types,
        quantization=_quantization(cfg, name),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=_first(cfg.get("eos_token_id")),
    )


def rope_of(
    cfg: dict[str, Any], family: Family, max_pos: int, name: str
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from either dialect. `scaling` is None for plain RoPE, else
    {"rope_type": ..., parameters} with the defaults transformers fills in made explicit."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(
            f"{name}: per-layer-type rope_parameters ({', '.join(params)}) are not supported; "
            "give one rope_parameters dict"
        )
    theta = params.get("rope_theta", cfg.get("rope_theta")) or family.rope_theta
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_KEYS:
        raise ConfigError(
            f"{name}: rope_type {kind!r} is not supported: use one of {', '.join(ROPE_KEYS)}"
        )
    for key in ("partial_rotary_factor",):
        value = params.get(key, cfg.get(key))
        if value not in (None, 1, 1.0):
            raise ConfigError(f"{name}: {key} = {value!r} is not supported: RoPE on the whole "
                              "head (1.0) only")  # fmt: skip
    unknown = sorted(set(params) - ROPE_KEYS[kind] - _ROPE_COMMON)
    if kind == "default":
        unknown = [k for k in unknown if k != "factor"]  # transformers ignores it there too
    if unknown:
        raise ConfigError(
            f"{name}: RoPE parameter {unknown[0]!r} is not supported for rope_type {kind!r}: "
            f"it takes {', '.join(sorted(ROPE_KEYS[kind])) or 'no parameters'}"
        )
    missing = sorted(_ROPE_REQUIRED.get(kind, set()) - set(params))
    if missing:
        raise ConfigError(f"{name}: rope_type {kind!r} needs {', '.join(missing)}")
    if kind == "default":
        return theta, None
    scaling = {"rope_type": kind} | {k: params[k] for k in sorted(ROPE_KEYS[kind]) if k in params}
    if kind in ("llama3", "yarn"):  # a top-level value wins, as in transformers (Phi-3 style)
        top = cfg.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = top or params.get(
            "original_max_position_embeddings", max_pos
        )
    if kind == "yarn" and scaling.get("factor") is None:
        scaling["factor"] = max_pos / scaling["original_max_position_embeddings"]
    return theta, scaling


def _windows(
    cfg: dict[str, Any], family: Family, num_layers: int, name: str
) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) as transformers' attention applies them."""
    window = cfg.get("sliding_window", family.sliding_window)
    if family.sliding == "none":
        if window is not None:
            raise ConfigError(
                f"{name}: sliding_window = {window!r} on {cfg.get('model_type', 'llama')} is not "
                "supported: sliding windows are read for mistral, mixtral, qwen2 and qwen3"
            )
        return None, ("full_attention",) * num_layers
    if family.sliding == "layers":
        if not cfg.get("use_sliding_window", False):
            window = None
        types = cfg.get("layer_types") or [
            "sliding_attention" if window is not None and i >= cfg.get("max_window_layers", 28)
            else "full_attention"
            for i in range(num_layers)
        ]  # fmt: skip
    else:
        types = ["sliding_attention" if window is not None else "full_attention"] * num_layers
    bad = sorted(set(types) - {"full_attention", "sliding_attention"})
    if bad or len(types) != num_layers:
        raise ConfigError(
            f"{name}: layer_types must be {num_layers} of full_attention / sliding_attention, "
            f"got {bad or len(types)}"
        )
    if window is None:
        types = ["full_attention"] * num_layers
    return window, tuple(types)


def _reject_unsupported(cfg: dict[str, Any], name: str) -> None:
    model_type = cfg.get("model_type", "llama")
    for key, value in cfg.items():
        on = bool(value) if key in SWITCHES else key in MULTIPLIERS and value not in (None, 1)
        if on:
            what = SWITCHES.get(key) or MULTIPLIERS[key]
            raise ConfigError(
                f"{name}: config.json key {key!r} ({what}) = {value!r} is not supported for "
                f"{model_type} models: remove it or use a model without {what}"
            )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{name}: hidden_act {act!r} is not supported: silu only")


def _quantization(cfg: dict[str, Any], name: str) -> quant_config.Quantization | None:
    stored = cfg.get("quantization_config")
    return quant_config.from_hf(stored, name) if stored else None


def _first(value: Any) -> int | None:
    return value[0] if isinstance(value, list) else value
