"""Weight-only quantized linear layers, and the quantizers that make them from fp weights.

int8: symmetric, one scale per output channel (W ≈ q · s, q in -127..127).
int4: asymmetric, a scale and a 4-bit zero point per group of input channels, as GPTQ and
AWQ store them (W ≈ (q - z) · s, q and z in 0..15, both packed two to a byte). GPTQ's
act-order checkpoints assign channels to groups out of order, so such a layer keeps its
channels sorted by group and permutes the input to match (`perm`).

The layers hold integers and scales only; the matmul is the hal op (`int8_linear`,
`int4_linear`), a reference that dequantizes per call unless a backend registers a kernel.
Scales are kept in the model's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from gpucloud.errors import ConfigError
from gpucloud.hal import ops
from gpucloud.models.quant_config import Quantization


class Int8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._op = ops.get("int8_linear")

    def extra_repr(self) -> str:
        out, cols = self.qweight.shape
        return f"in_features={cols}, out_features={out}, bias={self.bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.qweight, self.scales, self.bias)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.to(self.scales.dtype) * self.scales[:, None]


class Int4Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, quant: Quantization):
        super().__init__()
        if in_features % 2:
            raise ConfigError(f"int4 needs an even number of input channels, got {in_features}")
        self.group_size = quant.group(in_features)
        groups = -(-in_features // self.group_size)
        self.register_buffer("qweight", torch.empty(out_features, in_features // 2,
                                                    dtype=torch.uint8))  # fmt: skip
        self.register_buffer("scales", torch.empty(out_features, groups))
        self.register_buffer("zeros", torch.empty(out_features, -(-groups // 2),
                                                  dtype=torch.uint8))  # fmt: skip
        perm = torch.empty(in_features, dtype=torch.int32) if quant.act_order else None
        self.register_buffer("perm", perm)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._op = ops.get("int4_linear")

    def extra_repr(self) -> str:
        out, half = self.qweight.shape
        return (f"in_features={2 * half}, out_features={out}, bias={self.bias is not None}, "
                f"group_size={self.group_size}, act_order={self.perm is not None}")  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return self._op(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias)

    def dequantized(self) -> torch.Tensor:
        """The [out, in] weight in the original channel order."""
        w = ops.dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size)
        if self.perm is None:
            return w
        return torch.empty_like(w).index_copy_(1, self.perm.long(), w)


QUANTIZED = (Int8Linear, Int4Linear)


def make_linear(
    quant: Quantization | None, in_features: int, out_features: int, bias: bool = False
) -> nn.Module:
    """A projection of the decoder: nn.Linear, or its quantized form."""
    if quant is None:
        return nn.Linear(in_features, out_features, bias=bias)
    if quant.method == "int8":
        return Int8Linear(in_features, out_features, bias)
    return Int4Linear(in_features, out_features, bias, quant)


# ---- quantizers --------------------------------------------------------------------------
def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """An Int8Linear's buffers for an fp [out, in] weight; scales in `dtype`, and q rounded
    against those very scales."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float16).tiny).to(dtype)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return {"qweight": q, "scales": scales}


def quantize_int4(
    weight: torch.Tensor, group_size: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """An Int4Linear's buffers for an fp [out, in] weight: per group, min and max (with 0 in
    range, so that 0 stays exact, as GPTQ does) spread over 0..15."""
    q, scales, zeros = quantize_int4_values(weight, group_size, dtype)
    return {"qweight": pack_int4(q), "scales": scales, "zeros": pack_int4(zeros)}


def quantize_int4_values(
    weight: torch.Tensor, group_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [out, in] uint8 0..15, scales [out, groups] in `dtype`, zeros [out, groups] uint8)."""
    out, cols = weight.shape
    groups = -(-cols // group_size)
    w = weight.float()
    # Zero padding leaves every group's min(·, 0) and max(·, 0) as they are.
    padded = torch.nn.functional.pad(w, (0, groups * group_size - cols)).view(out, groups, -1)
    lo, hi = padded.amin(-1).clamp(max=0), padded.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).to(dtype)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    per_col = scales.float().repeat_interleave(group_size, dim=1)[:, :cols]
    z_col = zeros.repeat_interleave(group_size, dim=1)[:, :cols]
    q = (torch.round(w / per_col) + z_col).clamp(0, 15)
    return q.to(torch.uint8), scales, zeros.to(torch.uint8)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[rows, n] values 0..15 → [rows, ⌈n / 2⌉] uint8, even columns in the low nibble (an odd
    n is padded with a zero)."""
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, q.shape[1] % 2))
    return q[:, 0::2] | (q[:, 1::2] << 4)
