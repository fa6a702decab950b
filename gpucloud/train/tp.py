"""Tensor parallelism for the decoder family, Megatron-style, through DTensor.

Each decoder layer splits q/k/v and gate/up by output columns and o/down by input rows, so
attention heads and MLP channels live on different ranks and each block ends in one
reduction. The embedding is split by vocabulary rows and the LM head by vocabulary columns
(the same rows of a tied weight: one shard serves both); the logits are gathered whole for
the loss. Norms and the residual stream between blocks are sequence-parallel (Korthikanti
et al., 2022): each rank holds a slice of the sequence there, so the blocks' reductions
are reduce-scatters and their inputs all-gathers.

`parallelize` only annotates the model; FSDP2 on the data-parallel mesh dimension may wrap
it afterwards (2D). The planner counts the same split: every parameter but the norms'
divided by tp.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from gpucloud.models.llama import LlamaForCausalLM

_SEQ = Shard(1)  # [batch, seq, hidden]: the sequence dimension


def _layer_plan() -> dict[str, object]:
    # A block's input is gathered from sequence slices; its output reduce-scattered back.
    gathered = PrepareModuleInput(input_layouts=(_SEQ,), desired_input_layouts=(Replicate(),))
    attention_input = PrepareModuleInput(
        input_layouts=(_SEQ, None, None, None),  # x, cos, sin, the attention callable
        desired_input_layouts=(Replicate(), None, None, None),
    )
    return {
        "input_layernorm": SequenceParallel(),
        "self_attn": attention_input,
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=_SEQ),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": gathered,
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=_SEQ),
    }


def parallelize(model: LlamaForCausalLM, mesh: DeviceMesh) -> None:
    """Split `model` (fp32, on its device) in place over the 1-D tensor-parallel `mesh`.
    Every rank built the same weights (a seeded init or the same files), so each keeps its
    own slice: no scatter from a source rank. The layout (heads, KV heads, vocabulary, MLP
    width, sequence divisible by tp) is checked before any process starts (`preflight`)."""
    tp = mesh.size()
    outer = {  # a pipeline stage holds some of these only
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=_SEQ),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=_SEQ, output_layouts=Replicate()),
    }
    held = {"model.embed_tokens": model.model.embed_tokens, "model.norm": model.model.norm,
            "lm_head": model.lm_head}  # fmt: skip
    outer = {name: style for name, style in outer.items() if held[name] is not None}
    parallelize_module(model, mesh, outer, src_data_rank=None)
    if model.spec.tie_word_embeddings and len(outer) == 3:
        # Both styles made their own Shard(0) copy: keep the embedding's for both.
        model.lm_head.weight = model.model.embed_tokens.weight
    layers = model.model.layers
    for layer in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
        parallelize_module(layer, mesh, _layer_plan(), src_data_rank=None)
        # The projections now return this rank's heads only.
        layer.self_attn.num_heads //= tp
        layer.self_attn.num_kv_heads //= tp
