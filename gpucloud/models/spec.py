"""Architecture of a Llama-family decoder, in Hugging Face config terms, with the counts the
planner needs (parameters, FLOPs per token, KV bytes per token) computed from it.

Torch-free on purpose: the planner and the control plane use it without importing torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpucloud.errors import ConfigError
from gpucloud.models.hf_config import spec_kwargs
from gpucloud.models.quant_config import Quantization

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: Llama 2/3, Qwen2, Qwen3, Mistral, or Mixtral (MoE)."""

    name: str
    model_type: str  # llama | qwen2 | qwen3 | mistral | mixtral
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": linear|dynamic|llama3|yarn, ...}
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2; o_proj too: Llama, Qwen3)
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3)
    num_local_experts: int = 1  # > 1: MoE MLP (Mixtral)
    num_experts_per_tok: int = 1
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer: full_attention | sliding_attention
    quantization: Quantization | None = None  # weight-only quantized linear layers
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported: "
                f"use one of {', '.join(ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ConfigError(f"{self.name}: {name} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{self.name}: num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if not self.head_dim:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"{self.name}: num_attention_heads ({self.num_attention_heads}) must divide "
                    f"hidden_size ({self.hidden_size}) unless head_dim is given"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim % 2:
            raise ConfigError(f"{self.name}: head_dim ({self.head_dim}) must be even for RoPE")
        if not self.layer_types:
            kind = LAYER_TYPES[self.sliding_window is not None]
            object.__setattr__(self, "layer_types", (kind,) * self.num_hidden_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(
            LAYER_TYPES
        ):
            raise ConfigError(
                f"{self.name}: layer_types must list {', '.join(LAYER_TYPES)} for each of the "
                f"{self.num_hidden_layers} layers"
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ConfigError(f"{self.name}: sliding_attention layers need a sliding_window")
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ConfigError(
                f"{self.name}: num_experts_per_tok must be between 1 and num_local_experts"
            )

    # ---- derived sizes -------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 1

    def attention_window(self, layer_index: int) -> int | None:
        """How many keys (itself included) a query of this layer sees; None: all before it."""
        if self.layer_types[layer_index] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def o_proj_bias(self) -> bool:
        """HF Llama's and Qwen3's attention_bias biases o_proj too; Qwen2's does not."""
        return self.attention_bias and self.model_type in ("llama", "qwen3")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def attention_params_per_layer(self) -> int:
        h = self.hidden_size
        bias = (self.q_size + 2 * self.kv_size) if self.attention_bias else 0
        bias += h if self.o_proj_bias else 0
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        return h * self.q_size + 2 * h * self.kv_size + self.q_size * h + bias + qk_norm

    @property
    def expert_params(self) -> int:
        """One SwiGLU MLP: gate, up and down projections."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def router_params_per_layer(self) -> int:
        return self.hidden_size * self.num_local_experts if self.is_moe else 0

    @property
    def mlp_params_per_layer(self) -> int:
        return self.expert_params * self.num_local_experts + self.router_params_per_layer

    @property
    def params_per_layer(self) -> int:
        norms = 2 * self.hidden_size
        return self.attention_params_per_layer + self.mlp_params_per_layer + norms

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Every parameter, counted once (tied embeddings once), as sum(p.numel()) in torch."""
        return (
            self.embedding_params
            + self.num_hidden_layers * self.params_per_layer
            + self.hidden_size  # final norm
            + self.lm_head_params
        )

    @property
    def num_active_params(self) -> int:
        """Parameters a token passes through: only `num_experts_per_tok` experts for MoE."""
        inactive = (self.num_local_experts - self.num_experts_per_tok) * self.expert_params
        return self.num_params - self.num_hidden_layers * inactive

    @property
    def largest_layer_params(self) -> int:
        return max(self.params_per_layer, self.embedding_params)

    def kv_bytes_per_token(self, bytes_per_element: float) -> float:
        """K and V of every layer for one token: 2 · layers · kv_heads · head_dim · bytes."""
        return 2 * self.num_hidden_layers * self.kv_size * bytes_per_element

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """Matmul FLOPs per token: 6·N_active (2·N forward-only) plus causal attention.

        The embedding lookup does no matmul, so its parameters are left out unless tied to the
        LM head. Attention scores and the weighted sum cost 2·2·s·d per layer in the forward
        pass for a full square; causal masking halves that on average.
        """
        matmul_params = self.num_active_params - self.embedding_params
        if self.tie_word_embeddings:
            matmul_params += self.embedding_params
        attention = 2 * self.num_hidden_layers * seq_len * self.q_size  # causal: half of 4·s·d
        forward = 2 * matmul_params + attention
        return 3 * forward if training else forward

    # ---- Hugging Face config.json ⇄ spec -------------------------------------------
    def to_hf_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
            "use_cache": True,
        }
        if self.model_type in ("llama", "qwen3"):
            cfg["attention_bias"] = self.attention_bias
        if self.model_type in ("mistral", "mixtral", "qwen2", "qwen3"):
            cfg["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen3"):
            sliding = [t == "sliding_attention" for t in self.layer_types]
            cfg["use_sliding_window"] = any(sliding)
            cfg["layer_types"] = list(self.layer_types)
            # transformers 4 reads max_window_layers instead: the first sliding layer
            cfg["max_window_layers"] = sliding.index(True) if any(sliding) else len(sliding)
        if self.is_moe:
            cfg["num_local_experts"] = self.num_local_experts
            cfg["num_experts_per_tok"] = self.num_experts_per_tok
        return cfg

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "model") -> ModelSpec:
        """Build a spec from a config.json dict, in either transformers dialect. Raises
        ConfigError naming a missing key, or a key whose math is not implemented here."""
        return cls(**spec_kwargs(cfg, name))

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelSpec:
        """Read `path/config.json`. Raises ConfigError if it is missing or not JSON."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        try:
            cfg = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read model config {file}: {e}") from None
        return cls.from_hf_config(cfg, name=path.name if path.is_dir() else path.parent.name)

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        d.update(architecture=self.architecture, num_params=self.num_params,
                 num_active_params=self.num_active_params)  # fmt: skip
        return d
