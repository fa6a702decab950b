"""The Llama-family decoder (Llama 2/3, Qwen2/2.5, Qwen3, Mistral, Mixtral) with Hugging Face
weight names.

One definition serves training and serving. Every layer takes an `attention` callable
`(q, k, v, layer_index) -> out`: training passes nothing and gets causal attention over a
padded batch [batch, seq, ...] (windowed on sliding-window layers); the serving engine passes
paged attention over a flattened batch [tokens, ...]. Tensors keep whatever leading shape the
caller gives them. The families differ only in flags of the spec: q/k/v (and o) biases,
qk-norm, sliding-window layers, a top-k routed mixture of experts in place of the MLP. With
`spec.quantization` the projections (attention, MLP, experts) are weight-only int8/int4
layers; embeddings, the LM head, the router and the norms stay in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gpucloud.hal import ops
from gpucloud.models import moe
from gpucloud.models.quant import make_linear
from gpucloud.models.rope import rope_parameters
from gpucloud.models.spec import ModelSpec

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


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
        quant = spec.quantization
        self.q_proj = make_linear(quant, h, spec.q_size, bias=qkv_bias)
        self.k_proj = make_linear(quant, h, spec.kv_size, bias=qkv_bias)
        self.v_proj = make_linear(quant, h, spec.kv_size, bias=qkv_bias)
        self.o_proj = make_linear(quant, spec.q_size, h, bias=spec.o_proj_bias)
        if spec.qk_norm:  # Qwen3: each head's query and key normalized before RoPE
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self._rotary = ops.get("rotary")

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotary(q, cos, sin), self._rotary(k, cos, sin)
        out = attention(q, k, v, self.layer_index)
        return self.o_proj(out.reshape(*lead, -1))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, i, quant = spec.hidden_size, spec.intermediate_size, spec.quantization
        self.gate_proj = make_linear(quant, h, i)
        self.up_proj = make_linear(quant, h, i)
        self.down_proj = make_linear(quant, i, h)
        self._act = ops.get("silu_and_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._act(self.gate_proj(x), self.up_proj(x)))


class Expert(nn.Module):
    """One SwiGLU expert of a Mixtral layer, with Mixtral's names: w1 gate, w3 up, w2 down."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, i, quant = spec.hidden_size, spec.intermediate_size, spec.quantization
        self.w1 = make_linear(quant, h, i)
        self.w2 = make_linear(quant, i, h)
        self.w3 = make_linear(quant, h, i)
        self._act = ops.get("silu_and_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self._act(self.w1(x), self.w3(x)))


class SparseMoE(nn.Module):
    """Mixtral's MLP: a router picks each token's top-k experts; their outputs are summed,
    weighted by the router's softmax renormalized over the k chosen. Only chosen experts run.

    In training mode it keeps the batch's routing (router probabilities and choices, for the
    load-balancing loss) and the share of assignments it dropped past `capacity_factor`
    (None: no limit), for train.moe."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.top_k = spec.num_experts_per_tok
        self.gate = nn.Linear(spec.hidden_size, spec.num_local_experts, bias=False)
        self.experts = nn.ModuleList(Expert(spec) for _ in range(spec.num_local_experts))
        self.capacity_factor: float | None = None
        self.routing: tuple[torch.Tensor, torch.Tensor] | None = None
        self.dropped: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.gate(x).float().softmax(-1)
        weights, chosen = moe.top_k(probs, self.top_k)
        taken = torch.ones_like(chosen, dtype=torch.bool)
        # Training runs every expert, idle ones on no tokens, so each has a gradient (DDP
        # expects one for every parameter on every rank).
        experts = chosen.unique().tolist()  # ascending: the same summation order as HF
        if self.training:
            experts = range(len(self.experts))
            self.routing = probs, chosen
            if self.capacity_factor is not None:
                taken = moe.within_capacity(chosen, len(self.experts), self.capacity_factor)
            self.dropped = 1 - taken.float().mean()
        out = torch.zeros_like(x)
        for e in experts:
            tokens, slot = ((chosen == e) & taken).nonzero(as_tuple=True)
            y = self.experts[e](x[tokens]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = SelfAttention(spec, layer_index)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if spec.is_moe:  # HF's weight names: block_sparse_moe.{gate, experts.N.w1..3}
            self.block_sparse_moe = SparseMoE(spec)
        else:
            self.mlp = MLP(spec)
        # Under tensor parallelism a rank's attention and MLP outputs are partial sums over
        # its heads and columns; the serving engine sets this to their all-reduce.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _whole

    def forward(self, x, cos, sin, attention: Attention) -> torch.Tensor:
        x = x + self.reduce(self.self_attn(self.input_layernorm(x), cos, sin, attention))
        ffn = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        return x + self.reduce(ffn(self.post_attention_layernorm(x)))


def _whole(x: torch.Tensor) -> torch.Tensor:
    return x


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, decoder layers, final norm."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder with an LM head; `state_dict()` keys match HF's LlamaForCausalLM."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.reset_rope()
        self._causal = ops.get("causal_attention")

    def reset_rope(self, device: torch.device | str = "cpu") -> None:
        """(Re)compute RoPE's frequencies on `device`; a model built on meta needs this."""
        inv_freq, self.rope_scale = rope_parameters(self.spec)
        self.inv_freq = inv_freq.to(device)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for integer `positions` of any shape → shape + [head_dim], fp32."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.rope_scale == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.rope_scale, emb.sin() * self.rope_scale

    def causal_attention(self, q, k, v, layer_index: int) -> torch.Tensor:
        """Training's attention: causal over a padded batch, windowed on sliding layers."""
        return self._causal(q, k, v, window=self.spec.attention_window(layer_index))

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
            x = layer(x, cos, sin, attention or self.causal_attention)
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
