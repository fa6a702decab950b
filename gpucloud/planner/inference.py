"""Serving memory per GPU: quantized weights, an activation workspace, and the paged KV cache
that fills what is left of a GPU-memory fraction.

KV cache per token is 2 · layers · kv_heads · head_dim · bytes (K and V of every layer).
Under tensor parallelism each GPU holds what the serving engine gives a rank
(gpucloud.models.tensor_parallel): its share of the KV heads (or one replicated head when tp
exceeds them), of the attention heads and MLP columns, and of the vocabulary rows of the
embeddings and LM head, with the norms and the MoE router whole. Quantization applies to
the linear layers; embeddings, LM head and norms stay in 16-bit as GPTQ/AWQ/fp8 checkpoints
ship them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpucloud.models.quant_config import METHODS as QUANTIZATIONS
from gpucloud.models.quant_config import Quantization
from gpucloud.models.spec import ModelSpec
from gpucloud.models.tensor_parallel import rank_spec
from gpucloud.planner.memory import RUNTIME_OVERHEAD
from gpucloud.planner.setup import QUANTS, ServeSetup

MAX_NUM_SEQS = 256  # sequences sampled per step: sizes the fp32 logits in the workspace


@dataclass(frozen=True)
class InferenceMemory:
    weights_bytes: float  # the whole model at this quantization
    weights_per_gpu_bytes: float
    kv_bytes_per_token: float  # whole model: 2 · layers · kv_heads · head_dim · bytes
    kv_bytes_per_token_per_gpu: float
    workspace_bytes: float  # activations of one prefill chunk + sampled logits
    runtime_overhead_bytes: float
    budget_bytes: float  # memory_fraction × GPU memory
    kv_cache_bytes: float  # what is left for the cache (negative: weights do not fit)
    max_tokens_in_cache: int
    max_concurrent_seqs: int  # sequences of max_seq_len that fit at once
    required_seqs: int
    required_bytes: float  # everything for `required_seqs` full-length sequences

    @property
    def fits(self) -> bool:
        return self.max_concurrent_seqs >= self.required_seqs

    @property
    def shortfall_bytes(self) -> float:
        return max(0.0, self.required_bytes - self.budget_bytes)


def weights_bytes(spec: ModelSpec, quant: str, dense_bytes: int | None = None) -> float:
    """Bytes of all weights: quantized linear layers, 16-bit (or fp32) embeddings and norms.
    int8 and int4 count exactly what the serving engine allocates: integers, scales and zero
    points in `dense_bytes` (default: 4 for fp32, else 2), per layer; a GPTQ or AWQ spec
    (config.json's quantization_config) brings its group size and act-order."""
    dense = dense_bytes or (4 if quant == "fp32" else 2)
    if quant in QUANTIZATIONS:
        stored = spec.quantization
        q = stored if stored and stored.method == quant else Quantization(quant)
        shapes = quantized_linear_shapes(spec)
        rest = spec.num_params - sum(i * o for i, o in shapes)  # embeddings, norms, biases...
        return sum(quantized_layer_bytes(i, o, q, dense) for i, o in shapes) + rest * dense
    vocab = spec.embedding_params + spec.lm_head_params
    norms = (2 * spec.num_hidden_layers + 1) * spec.hidden_size
    linear = spec.num_params - vocab - norms
    return linear * QUANTS[quant] + (vocab + norms) * dense


def weights_per_gpu_bytes(
    spec: ModelSpec, quant: str, tp: int, dense_bytes: int | None = None
) -> float:
    """Bytes of the weights each of `tp` ranks holds (`weights_bytes` of one rank's share)."""
    return weights_bytes(rank_spec(spec, tp), quant, dense_bytes)


def quantized_linear_shapes(spec: ModelSpec) -> list[tuple[int, int]]:
    """(in, out) of each projection weight-only quantization applies to: attention's q, k,
    v, o and the MLP's (every expert's) gate, up, down, in every layer. The router stays."""
    h, i = spec.hidden_size, spec.intermediate_size
    attention = [(h, spec.q_size), (h, spec.kv_size), (h, spec.kv_size), (spec.q_size, h)]
    mlp = [(h, i), (h, i), (i, h)] * spec.num_local_experts
    return (attention + mlp) * spec.num_hidden_layers


def quantized_layer_bytes(in_features: int, out_features: int, q: Quantization, dense: int):
    """int8: a byte per weight and a scale per output channel. int4: half a byte per weight, a
    scale and a 4-bit zero point per group and output channel (an odd group count padded to
    a whole byte), and with act-order the input permutation (int32)."""
    if q.method == "int8":
        return out_features * (in_features + dense)
    groups = -(-in_features // q.group(in_features))
    perm = 4 * in_features if q.act_order else 0
    return out_features * (in_features // 2 + groups * dense + -(-groups // 2)) + perm


def kv_heads_per_gpu(spec: ModelSpec, tp: int) -> int:
    return max(1, spec.num_key_value_heads // tp)


def workspace_bytes(spec: ModelSpec, setup: ServeSetup) -> float:
    """Peak activations of a forward pass over one prefill chunk (residual, norm output, q/k/v,
    the MLP's gate, up and product) in 16-bit, plus fp32 logits for the sampled sequences."""
    tp, chunk = setup.tp, min(setup.prefill_chunk, setup.max_seq_len * setup.required_seqs)
    kv = kv_heads_per_gpu(spec, tp) * spec.head_dim
    per_token = 2 * spec.hidden_size + (spec.q_size / tp + 2 * kv) + 3 * spec.intermediate_size / tp
    logits = min(MAX_NUM_SEQS, chunk) * spec.vocab_size / tp * 4
    return chunk * per_token * 2 + logits


def estimate_inference_memory(spec: ModelSpec, setup: ServeSetup) -> InferenceMemory:
    """Per-GPU serving memory for `spec` under `setup` (assumed checked)."""
    tp = setup.tp
    weights = weights_bytes(spec, setup.quant)
    per_gpu_weights = weights_per_gpu_bytes(spec, setup.quant, tp)
    kv_token = spec.kv_bytes_per_token(setup.kv_bytes)
    kv_token_gpu = (
        2 * spec.num_hidden_layers * kv_heads_per_gpu(spec, tp) * spec.head_dim * setup.kv_bytes
    )
    workspace = workspace_bytes(spec, setup)
    budget = setup.memory_fraction * setup.gpu.memory_bytes
    cache = budget - per_gpu_weights - workspace - RUNTIME_OVERHEAD
    blocks = max(0, math.floor(cache / (kv_token_gpu * setup.block_size)))
    tokens = blocks * setup.block_size
    seq_blocks = math.ceil(setup.max_seq_len / setup.block_size)
    required = (
        per_gpu_weights
        + workspace
        + RUNTIME_OVERHEAD
        + setup.required_seqs * seq_blocks * setup.block_size * kv_token_gpu
    )
    return InferenceMemory(
        weights_bytes=weights,
        weights_per_gpu_bytes=per_gpu_weights,
        kv_bytes_per_token=kv_token,
        kv_bytes_per_token_per_gpu=kv_token_gpu,
        workspace_bytes=workspace,
        runtime_overhead_bytes=RUNTIME_OVERHEAD,
        budget_bytes=budget,
        kv_cache_bytes=cache,
        max_tokens_in_cache=tokens,
        max_concurrent_seqs=blocks // seq_blocks,
        required_seqs=setup.required_seqs,
        required_bytes=required,
    )
