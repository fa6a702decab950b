"""Bytes of activations a training step keeps for backward, per token.

Two counts:

- `decoder_*`: a component-wise count of what OUR decoder (`gpucloud/models/llama.py`) saves,
  tensor by tensor. Checked against the torch profiler on CPU (tests/planner), where it is
  within 0.1% for fp32 and pure bf16. Per decoder layer it keeps:
  * each RMSNorm: its input in fp32 (norms compute in fp32), the fp32 1/rms per token, the
    normalized input and the scaled output in the compute dtype;
  * attention: q and k after rotary, v, the attention output (flash attention keeps no
    scores) and one fp32 log-sum-exp per head; in bf16, rotary's cos/sin cast per call;
  * SwiGLU MLP: gate, up, silu(gate) and their product (for MoE, in each of the top-k
    experts a token is routed to).
  The final norm follows the same rule; cross-entropy's fp32 log-softmax (the logits
  themselves die in forward) is counted separately (`cross_entropy_*`) because it
  dominates small models.
- `korthikanti_*`: the formula of Korthikanti et al. 2022 ("Reducing Activation
  Recomputation in Large Transformer Models"), s·b·h·(34 + 5·a·s/h) bytes per layer for
  16-bit GPT layers, adapted to GQA, SwiGLU and no dropout: s·b·(4h + 2q + 2kv + 4i + a·s)
  elements per layer. Kept as a reference line: it ignores what norms in fp32 save and
  counts the s² scores flash attention never stores.

Mixed precision follows the training runtime: FSDP (ZeRO-2/3) computes in 16-bit with
MixedPrecisionPolicy, so the count is the pure 16-bit one; DDP (ZeRO-0/1) runs fp32 weights
under torch.autocast, which keeps the residual stream in fp32 and adds 16-bit casts
(`autocast=True`). Both checked against the profiler on CPU.

Tensor parallelism (`tp`) splits heads, the MLP width and (vocab-parallel) the logits; the
hidden-size tensors split only under sequence parallelism (`sp`).
"""

from __future__ import annotations

import math

from gpucloud.models.spec import ModelSpec


def _local_kv(spec: ModelSpec, tp: int) -> int:
    """KV width on one tensor-parallel rank: heads split, or replicated when tp > kv heads."""
    return max(1, spec.num_key_value_heads // tp) * spec.head_dim


def decoder_layer_bytes(
    spec: ModelSpec, act_bytes: int, tp: int = 1, sp: bool = False, autocast: bool = False
) -> float:
    """Bytes one decoder layer saves per token (no recomputation).

    Under torch.autocast (fp32 weights, 16-bit matmuls) the residual stream and the norms
    stay fp32, and each projection saves its own 16-bit cast of its fp32 input: q, k, v of
    the first norm's output, gate and up of the second's.
    """
    e, h = act_bytes, spec.hidden_size / (tp if sp else 1)
    norms = 2 * norm_bytes(h, e)
    casts = 5 * e * h if autocast else 0
    q, kv = spec.q_size / tp, _local_kv(spec, tp)
    heads = spec.num_attention_heads / tp
    rope_copies = 0 if e == 4 else 4 * e * spec.head_dim  # cos, sin cast for q and for k
    attention = e * (2 * q + 2 * kv) + 4 * heads + rope_copies
    mlp = 4 * e * spec.intermediate_size * spec.num_experts_per_tok / tp  # MoE: top-k experts
    return norms + casts + attention + mlp


def norm_bytes(h: float, e: int) -> float:
    """RMSNorm: fp32 input, fp32 1/rms, normalized input and output in the compute dtype."""
    return 4 * h + 4 + 2 * e * h


def decoder_shared_bytes(spec: ModelSpec, act_bytes: int) -> float:
    """Per-token tensors every layer shares: fp32 rotary cos/sin (cast per layer in bf16)."""
    return 2 * 4 * spec.head_dim if act_bytes == 4 else 0


def checkpoint_layer_bytes(spec: ModelSpec, act_bytes: int, tp: int = 1, sp: bool = False) -> float:
    """Bytes per token a checkpointed layer keeps: its input in the compute dtype."""
    return act_bytes * spec.hidden_size / (tp if sp else 1)


def checkpoint_shared_bytes(spec: ModelSpec) -> float:
    """Checkpointed layers keep rotary's fp32 cos/sin as inputs, shared by every layer."""
    return 2 * 4 * spec.head_dim


def final_norm_bytes(
    spec: ModelSpec, act_bytes: int, tp: int = 1, sp: bool = False, autocast: bool = False
) -> float:
    """The final norm, plus the LM head's 16-bit cast of its output under autocast."""
    h = spec.hidden_size / (tp if sp else 1)
    return norm_bytes(h, act_bytes) + (act_bytes * h if autocast else 0)


def cross_entropy_held_bytes(spec: ModelSpec, tp: int = 1) -> float:
    """Per token, alive from the loss to its backward: the fp32 log-softmax cross-entropy
    saves. The logits themselves die in forward: nothing holds them (the training step
    passes them straight to the loss) and log-softmax's backward needs only its output."""
    return 4 * spec.vocab_size / tp


def cross_entropy_backward_bytes(spec: ModelSpec, tp: int = 1) -> float:
    """Per token, added at the start of backward: the fp32 gradients of the log-softmax
    output and of its input, alive together."""
    return 8 * spec.vocab_size / tp


def logits_bytes(spec: ModelSpec, act_bytes: int, tp: int = 1) -> float:
    """Per token: the logits in the compute dtype (a pipeline schedule keeps each
    micro-batch's, to return them merged when the step ends)."""
    return act_bytes * spec.vocab_size / tp


def korthikanti_layer_bytes(
    spec: ModelSpec,
    seq_len: int,
    act_bytes: int,
    recompute: str = "none",
    tp: int = 1,
    sp: bool = False,
) -> float:
    """Korthikanti et al.'s per-layer activation bytes per token, adapted (see module doc)."""
    h = spec.hidden_size
    if recompute == "full":
        return act_bytes * h / (tp if sp else 1)
    replicated = 4 * h  # two norm inputs, QKV input, MLP input: split only under sp
    split = (
        2 * spec.q_size + 2 * spec.kv_size + 4 * spec.intermediate_size * spec.num_experts_per_tok
    )
    scores = 0 if recompute == "selective" else spec.num_attention_heads * seq_len
    return act_bytes * (replicated / (tp if sp else 1) + (split + scores) / tp)


def korthikanti_original_layer_bytes(spec: ModelSpec, seq_len: int) -> float:
    """The paper's own figure per token, s·b·h·(34 + 5·a·s/h) / (s·b), for 16-bit GPT layers."""
    h, a = spec.hidden_size, spec.num_attention_heads
    return h * (34 + 5 * a * seq_len / h)


def stage_layers(spec: ModelSpec, pp: int) -> int:
    """Decoder layers on the busiest pipeline stage."""
    return math.ceil(spec.num_hidden_layers / pp)
