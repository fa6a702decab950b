"""Checkpoint tensors of a quantized layer ⇄ the buffers of gpucloud.models.quant's layers.

Per projection `P` (e.g. `model.layers.0.self_attn.q_proj`), with 4-bit values packed eight
to an int32 word, value k in bits 4k..4k+3:

- GPTQ (AutoGPTQ, GPTQModel): `P.qweight` int32 [in / 8, out], word r of a column holding
  input channels 8r..8r+7; `P.qzeros` int32 [groups, out / 8], packed along output channels
  the same way and stored minus one in the original format (`gptq`; `gptq_v2` stores them
  as they are; a v1 zero of 0 reads back as 16 in GPTQ's kernels, refused here);
  `P.scales` fp16 [groups, out]; `P.g_idx` int32 [in], each input channel's group
  (out of order in act-order checkpoints).
- AWQ (AutoAWQ, GEMM version): `P.qweight` int32 [in, out / 8] packed along output channels,
  the eight channels of a word interleaved (bits 4k hold channel AWQ_ORDER[k]); `P.qzeros`
  int32 [groups, out / 8] likewise, no offset; `P.scales` fp16 [groups, out]; groups of
  consecutive input channels.
- fp (quantized at load): `P.weight` [out, in], quantized by gpucloud.models.quant.
"""

from __future__ import annotations

import torch

from gpucloud.errors import ConfigError
from gpucloud.models.quant import pack_int4, quantize_int4, quantize_int8
from gpucloud.models.quant_config import Quantization
from gpucloud.models.tensor_parallel import Shard

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNDO = tuple(AWQ_ORDER.index(c) for c in range(8))  # word position of channel c
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def stored_tensors(
    fp_state: dict[str, torch.Tensor], prefixes: list[str], quant: Quantization
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The checkpoint's tensors (meta, with their shapes) for a model whose fp state dict is
    `fp_state` and whose `prefixes` are quantized, and the keys a checkpoint may leave out."""
    expected, optional = dict(fp_state), set()
    if quant.checkpoint == "fp":
        return expected, optional
    for p in prefixes:
        out, cols = expected.pop(f"{p}.weight").shape
        groups = -(-cols // quant.group(cols))
        packed = (cols // 8, out) if quant.checkpoint != "awq" else (cols, out // 8)
        expected |= {
            f"{p}.qweight": _meta(packed, torch.int32),
            f"{p}.qzeros": _meta((groups, out // 8), torch.int32),
            f"{p}.scales": _meta((groups, out), torch.float16),
        }
        if quant.checkpoint != "awq":
            expected[f"{p}.g_idx"] = _meta((cols,), torch.int32)
            optional.add(f"{p}.g_idx")  # old GPTQ checkpoints without act-order omit it
    return expected, optional


def to_layers(
    state: dict[str, torch.Tensor],
    prefixes: list[str],
    quant: Quantization,
    dtype: torch.dtype,
    shard: Shard | None = None,
) -> None:
    """Replace, in `state`, each quantized projection's checkpoint tensors by its layer's
    buffers; with `shard`, a GPTQ/AWQ projection's tensor-parallel part (an fp checkpoint is
    sliced before it is quantized). Raises ConfigError when a GPTQ g_idx does not form
    groups of group_size."""
    for p in prefixes:
        if quant.checkpoint == "fp":
            weight = state.pop(f"{p}.weight")
            cols = weight.shape[1]
            buffers = (quantize_int8(weight, dtype) if quant.method == "int8"
                       else quantize_int4(weight, quant.group(cols), dtype))  # fmt: skip
        else:
            q, zeros, scales, buffers = _unpacked(state, p, quant)
            if shard is not None:
                q, zeros, scales = shard.int4(p.rpartition(".")[2], q, zeros, scales)
            buffers |= _int4(q, zeros, scales)
        buffers["scales"] = buffers["scales"].to(dtype)
        state.update({f"{p}.{k}": t for k, t in buffers.items()})


def _unpacked(state: dict[str, torch.Tensor], p: str, quant: Quantization):
    """Projection `p`'s GPTQ/AWQ tensors, taken out of `state`: [out, in] values, [groups,
    out] zero points and scales, and the layer's other buffers (GPTQ's act-order `perm`)."""
    stored = [state.pop(f"{p}.{k}") for k in ("qweight", "qzeros", "scales")]
    if quant.checkpoint == "awq":
        return *_from_awq(*stored), {}
    return _from_gptq(*stored, state.pop(f"{p}.g_idx", None), quant, p)


def _from_gptq(qweight, qzeros, scales, g_idx, quant: Quantization, name: str):
    q = unpack_rows(qweight).T  # [out, in]
    zeros = unpack_cols(qzeros) + (1 if quant.checkpoint == "gptq" else 0)
    if (zeros > 15).any():  # a v1 zero of 0 wraps to 16: the only one that needs 5 bits
        raise ConfigError(f"{name}.qzeros holds zero point 16 (0 stored minus one), which 4-bit "
                          "zero points cannot hold: re-save the checkpoint as gptq_v2")  # fmt: skip
    cols = q.shape[1]
    in_order = torch.arange(cols, dtype=torch.int32, device=q.device) // quant.group(cols)
    buffers = {}
    if g_idx is not None and not torch.equal(g_idx.to(torch.int32), in_order):
        perm = torch.argsort(g_idx, stable=True).to(torch.int32)
        if not quant.act_order or not torch.equal(g_idx[perm].to(torch.int32), in_order):
            raise ConfigError(
                f"{name}.g_idx does not assign input channels to groups of "
                f"{quant.group(cols)}{'' if quant.act_order else ' in order (desc_act is false)'}"
            )
        q = q[:, perm]
        buffers["perm"] = perm
    elif quant.act_order:
        buffers["perm"] = torch.arange(cols, dtype=torch.int32, device=q.device)
    return q, zeros, scales, buffers


def _from_awq(qweight, qzeros, scales):
    return unpack_cols(qweight, _AWQ_UNDO).T, unpack_cols(qzeros, _AWQ_UNDO), scales


def _int4(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """Buffers from [out, in] values and [groups, out] zeros and scales. Contiguous: the
    unpacked values are transposed views, whose strides packing would keep, and the cpu
    kernel takes contiguous buffers only."""
    return {
        "qweight": pack_int4(q.contiguous()),
        "scales": scales.T.contiguous(),
        "zeros": pack_int4(zeros.T.contiguous()),
    }


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols] → [rows * 8, cols]: each word's eight values down its column."""
    values = (packed[:, None, :] >> _SHIFTS.to(packed.device)[None, :, None]) & 0xF
    return values.reshape(-1, packed.shape[1])


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [rows, cols] → [rows, cols * 8]: each word's eight values along its row, taken in
    `order` (channel c of a word from position order[c]; default: in place)."""
    values = (packed[..., None] >> _SHIFTS.to(packed.device)) & 0xF
    if order is not None:
        values = values[..., list(order)]
    return values.reshape(packed.shape[0], -1)


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")
