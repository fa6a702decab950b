"""How a Llama-family model splits across tensor-parallel ranks (Megatron-style).

Each rank holds a contiguous slice of the attention heads and of the MLP's (every expert's)
intermediate columns: q/k/v and gate/up are column-parallel (output rows sliced), o and down
row-parallel (input columns sliced), so a layer's attention and MLP outputs are partial sums
that one all-reduce completes. The embeddings and the LM head are split by vocabulary rows
(the last rank's slice padded with zero rows when the vocabulary does not divide). Norms,
qk-norm weights and the MoE router are replicated; a row-parallel bias (o_proj's) is held
by rank 0 and zero elsewhere, so the all-reduce adds it once.

`rank_spec` is the architecture of one rank's modules: the planner sizes a device with it
and the loader builds a rank's model from it. Torch-free (tensors are sliced with their own
methods), so the planner can use it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gpucloud.errors import ConfigError
from gpucloud.models.spec import ModelSpec

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")
_ROW = ("o_proj", "down_proj", "w2")
_VOCAB = ("embed_tokens", "lm_head")


def vocab_rows(vocab_size: int, size: int) -> int:
    """Vocabulary rows each of `size` ranks holds (the last one padded)."""
    return -(-vocab_size // size)


def check_tensor_parallel(spec: ModelSpec, size: int) -> None:
    """Raise ConfigError (one line) unless `size` ranks can split `spec` evenly: attention
    heads, KV heads and MLP columns, from an unquantized checkpoint."""
    if size < 1:
        raise ConfigError(f"tensor parallel size must be a positive integer, got {size}")
    for what, count in (("attention heads", spec.num_attention_heads),
                        ("KV heads", spec.num_key_value_heads),
                        ("MLP intermediate size", spec.intermediate_size)):  # fmt: skip
        if count % size:
            divisors = [d for d in range(1, count + 1) if count % d == 0 and d <= 16]
            raise ConfigError(
                f"--tensor-parallel-size {size} does not divide the {count} {what} of "
                f"{spec.name}: use one of {', '.join(map(str, divisors))}"
            )
    q = spec.quantization
    if q is not None and q.checkpoint != "fp":
        _check_int4_checkpoint(spec, size)


def _check_int4_checkpoint(spec: ModelSpec, size: int) -> None:
    """A GPTQ/AWQ checkpoint splits where each rank's input slice of a row-parallel
    projection (o, down) is whole groups, in input order (no act-order permutation)."""
    q = spec.quantization
    if q.act_order:
        raise ConfigError(
            f"{spec.name} is a {q.checkpoint} checkpoint with act-order (desc_act): its groups "
            "are scattered over the input channels, which tensor parallelism splits; serve it "
            "with --tensor-parallel-size 1, or a checkpoint saved without desc_act"
        )
    for what, inputs in (("o_proj", spec.q_size), ("down_proj", spec.intermediate_size)):
        part = inputs // size
        if q.group_size != -1 and part % q.group(inputs):
            raise ConfigError(
                f"--tensor-parallel-size {size} splits the {inputs} inputs of {what} into "
                f"{part} per rank, not a multiple of the {q.checkpoint} group size "
                f"{q.group_size}: use a size that keeps whole groups"
            )


def rank_spec(spec: ModelSpec, size: int) -> ModelSpec:
    """One rank's share of `spec`: its heads (KV heads replicated when `size` exceeds them,
    as the planner allows), its MLP columns, its vocabulary rows; everything else whole."""
    if size == 1:
        return spec
    return replace(
        spec,
        num_attention_heads=spec.num_attention_heads // size,
        num_key_value_heads=max(1, spec.num_key_value_heads // size),
        head_dim=spec.head_dim,
        intermediate_size=-(-spec.intermediate_size // size),
        vocab_size=vocab_rows(spec.vocab_size, size),
    )


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`: what the loader keeps of each checkpoint tensor."""

    rank: int
    size: int

    def spec(self, spec: ModelSpec) -> ModelSpec:
        return rank_spec(spec, self.size)

    def tensor(self, name: str, tensor):
        """This rank's part of the checkpoint tensor `name` (HF names), contiguous."""
        module, _, kind = name.rpartition(".")
        layer = module.rpartition(".")[2]
        if layer in _VOCAB:
            return self._vocab(tensor)
        if layer in _COLUMN:
            return self._slice(tensor, 0)
        if layer in _ROW and kind == "weight":
            return self._slice(tensor, 1)
        if layer in _ROW:  # its bias: added once, by rank 0
            return tensor if self.rank == 0 else tensor.new_zeros(tensor.shape)
        return tensor

    def lora_pair(self, module: str, a, b):
        """This rank's part of a LoRA adapter's (A [r, in], B [out, r]) on projection `module`:
        B's rows of a column-parallel projection's outputs, A's columns of a row-parallel
        one's inputs (whose partial products the layer's all-reduce sums like the base's)."""
        if module in _COLUMN:
            return a, self._slice(b, 0)
        if module in _ROW:
            return self._slice(a, 1), b
        return a, b

    def int4(self, module: str, q, zeros, scales):
        """This rank's part of a GPTQ/AWQ projection `module` unpacked: [out, in] values and
        [groups, out] zero points and scales. A row-parallel projection keeps its input
        channels' groups; one group spanning the whole row stays whole on every rank (its
        slice of the row is the rank's one group)."""
        if module in _COLUMN:
            return self._slice(q, 0), self._slice(zeros, 1), self._slice(scales, 1)
        if module not in _ROW:
            return q, zeros, scales
        if scales.shape[0] == 1:
            return self._slice(q, 1), zeros, scales
        return self._slice(q, 1), self._slice(zeros, 0), self._slice(scales, 0)

    def _slice(self, tensor, dim: int):
        part = tensor.shape[dim] // self.size
        return tensor.narrow(dim, self.rank * part, part).contiguous()

    def _vocab(self, tensor):
        rows = vocab_rows(tensor.shape[0], self.size)
        start = min(self.rank * rows, tensor.shape[0])
        part = tensor[start : start + rows]
        if part.shape[0] == rows:
            return part.contiguous()
        out = part.new_zeros((rows, *part.shape[1:]))
        out[: part.shape[0]] = part
        return out
