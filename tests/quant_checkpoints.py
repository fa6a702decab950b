"""GPTQ- and AWQ-format checkpoints written from an fp model directory by our own packer, so
the loader's unpacking is checked against weights we know: each projection is quantized
group-wise to 4 bits, and the dequantized weight it encodes is returned alongside.

The packing follows the formats' conventions (see gpucloud.models.quant_formats) and is
written the other way round from the loader — OR-ing each 4-bit slot into int64 words — so
that it shares no code with the loader's unpacking.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gpucloud.models.quant import quantize_int4_values
from gpucloud.models.quant_formats import AWQ_ORDER

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "w1", "w2", "w3")  # fmt: skip


def write_checkpoint(
    src: Path, out: Path, fmt: str, group_size: int, act_order: bool = False, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Copy the model directory `src` to `out` with its projections stored as `fmt` (gptq,
    gptq_v2 or awq). Returns each projection's dequantized fp32 weight, by its prefix."""
    shutil.copytree(src, out)
    state = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    expected = {}
    for key in [k for k in state if k.removesuffix(".weight").rsplit(".", 1)[-1] in PROJECTIONS]:
        prefix = key.removesuffix(".weight")
        weight = state.pop(key)
        g = min(group_size, weight.shape[1]) if group_size != -1 else weight.shape[1]
        g_idx = _group_index(weight.shape[1], g, act_order, gen)
        q, scales, zeros = _quantize(weight, g_idx, g)
        expected[prefix] = (q.float() - zeros[:, g_idx].float()) * scales[:, g_idx].float()
        state |= _pack(prefix, fmt, q, scales, zeros, g_idx)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = _config(fmt, group_size, act_order)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return expected


def _group_index(cols: int, g: int, act_order: bool, gen: torch.Generator) -> torch.Tensor:
    """Each input channel's group: in order, or (act-order) groups of a random permutation."""
    order = torch.randperm(cols, generator=gen) if act_order else torch.arange(cols)
    g_idx = torch.empty(cols, dtype=torch.int32)
    g_idx[order] = (torch.arange(cols) // g).to(torch.int32)
    return g_idx


def _quantize(weight: torch.Tensor, g_idx: torch.Tensor, g: int):
    """q [out, in] in the original channel order; fp16 scales and zeros [out, groups]."""
    order = torch.argsort(g_idx, stable=True)
    q_sorted, scales, zeros = quantize_int4_values(weight[:, order], g, torch.float16)
    q = torch.empty_like(q_sorted)
    q[:, order] = q_sorted
    return q, scales, zeros


def _pack(prefix, fmt, q, scales, zeros, g_idx) -> dict[str, torch.Tensor]:
    q, zeros = q.long(), zeros.long()
    if fmt == "awq":
        return {
            f"{prefix}.qweight": _pack_words(q.T, along_rows=False, order=AWQ_ORDER),
            f"{prefix}.qzeros": _pack_words(zeros.T, along_rows=False, order=AWQ_ORDER),
            f"{prefix}.scales": scales.T.contiguous(),
        }
    stored_zeros = (zeros - 1) & 0xF if fmt == "gptq" else zeros  # v1 stores zero - 1
    return {
        f"{prefix}.qweight": _pack_words(q.T, along_rows=True),
        f"{prefix}.qzeros": _pack_words(stored_zeros.T, along_rows=False),
        f"{prefix}.scales": scales.T.contiguous(),
        f"{prefix}.g_idx": g_idx,
    }


def _pack_words(values: torch.Tensor, along_rows: bool, order=tuple(range(8))) -> torch.Tensor:
    """int32 words of eight 4-bit values: value k of a word in bits 4k..4k+3, taken from
    row (along_rows) or column 8w + order[k] of `values`."""
    rows, cols = values.shape
    shape = (rows // 8, cols) if along_rows else (rows, cols // 8)
    words = torch.zeros(shape, dtype=torch.int64)
    for k in range(8):
        part = values[order[k] :: 8] if along_rows else values[:, order[k] :: 8]
        words |= part << (4 * k)
    return words.to(torch.uint32).view(torch.int32)


def _config(fmt: str, group_size: int, act_order: bool) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size,
                "zero_point": True, "version": "gemm"}  # fmt: skip
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order,
            "sym": False, "checkpoint_format": fmt, "damp_percent": 0.01}  # fmt: skip
