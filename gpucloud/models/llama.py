"""The Llama-family decoder (Llama 2/3, Qwen2, Mistral) with Hugging Face weight names.

One definition serves training and serving. Every layer takes an `attention` callable
`(q, k, v, layer_index) -> out`: training passes nothing and gets causal attention over a
padded batch [batch, seq, ...]; the serving engine passes paged attention over a flattened
batch [tokens, ...]. Tensors keep whatever leading shape the caller gives them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from gpucloud.errors import ConfigError
from gpucloud.hal import ops
from gpucloud.models.spec import ModelSpec

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies of RoPE, with Llama-3 or linear scaling when the config asks for it."""
    dim = spec.head_dim
    # Always on CPU: a model built under `torch.device("meta")` still gets real frequencies,
    # and the meta kernel of `scalar ** tensor` would import torch._dynamo (seconds).
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (spec.rope_theta**exponents)
    scaling = spec.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ConfigError(
        f"{spec.name}: rope_scaling type {kind!r} is not supported; use default, linear or llama3"
    )


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self._op = ops.get("rms_norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.weight, self.eps)


class SelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int):
        super().__init__()
        h, qkv_bias = spec.hidden_size, spec.attention_bias
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads = spec.num_attention_heads, spec.num_key_value_heads
        self.head_dim = spec.head_dim
        self.q_proj = nn.Linear(h, spec.q_size, bias=qkv_bias)
        self.k_proj = nn.Linear(h, spec.kv_size, bias=qkv_bias)
        self.v_proj = nn.Linear(h, spec.kv_size, bias=qkv_bias)
        # HF Llama's attention_bias biases o_proj too; Qwen2 biases q/k/v only.
        self.o_proj = nn.Linear(spec.q_size, h, bias=qkv_bias and spec.model_type == "llama")
        self._rotary = ops.get("rotary")

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        q, k = self._rotary(q, cos, sin), self._rotary(k, cos, sin)
        out = attention(q, k, v, self.layer_index)
        return self.o_proj(out.reshape(*lead, -1))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, i = spec.hidden_size, spec.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self._act = ops.get("silu_and_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._act(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = SelfAttention(spec, layer_index)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, cos, sin, attention: Attention) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, decoder layers, final norm."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


def _causal(q, k, v, layer_index):  # noqa: ARG001 - same signature as paged attention
    return _CAUSAL(q, k, v)


_CAUSAL = ops.get("causal_attention")


class LlamaForCausalLM(nn.Module):
    """Decoder with an LM head; `state_dict()` keys match HF's LlamaForCausalLM."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        if spec.is_moe:
            raise ConfigError(
                f"{spec.name}: mixture-of-experts models are supported by the planner only; "
                "the runtime runs dense Llama/Qwen2/Mistral models"
            )
        self.spec = spec
        self.model = Backbone(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(spec), persistent=False)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for integer `positions` of any shape → shape + [head_dim], fp32."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention: Attention | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states for `input_ids` ([batch, seq] or flattened [tokens])."""
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
            positions = positions.expand_as(input_ids)
        cos, sin = self.rope(positions)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attention or _causal)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention: Attention | None = None,
    ) -> torch.Tensor:
        return self.compute_logits(self.hidden_states(input_ids, positions, attention))

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """HF-style random init: normal(0, std) matrices, zero biases, unit norms."""
        gen = torch.Generator().manual_seed(seed)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
