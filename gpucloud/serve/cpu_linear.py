"""A served model's fp projections, their weights reordered once for oneDNN's CPU matmul.

torch's CPU `linear` hands fp32 to MKL's sgemm, which reads the plain [out, in] weight and,
on AMD processors, runs its AVX2 code; oneDNN's matmul over a weight reordered once into
its blocked layout runs 2-2.5x the FLOP/s on every shape a serving step has (1 to 512 rows,
fp32 and bf16: `benchmarks/serve_offline.py --profile` shows the matmul share). The engine's
runner swaps each `nn.Linear` for a `PackedLinear` when it serves on the CPU. The packed
layer holds no other copy of its weight (the same bytes as before); `state_dict()`,
`weight` and `deepcopy` give the plain weight back, so a packed model still saves, copies
and builds its transformers twin. A weight an embedding shares (tied LM head) stays as it
is: the embedding lookup needs the plain layout, and two copies would cost memory.
"""

from __future__ import annotations

import torch
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """Whether this torch build has oneDNN's packed linear ops."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


class PackedLinear(nn.Module):
    """`nn.Linear` on a oneDNN-packed weight; same inputs, same outputs up to rounding."""

    def __init__(self, weight: torch.Tensor, bias: nn.Parameter | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = bias

    @classmethod
    def of(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed=onednn")  # fmt: skip

    @property
    def weight(self) -> torch.Tensor:
        """The plain [out, in] weight (a new tensor: reading it costs a copy)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def __deepcopy__(self, memo):
        bias = None if self.bias is None else nn.Parameter(self.bias.detach().clone(),
                                                           self.bias.requires_grad)  # fmt: skip
        return PackedLinear(self.weight, bias)


def pack_linears(model: nn.Module) -> int:
    """Swap, in place, every `nn.Linear` of `model` held on the CPU in fp32 or bf16 (and
    not sharing its weight with an embedding) for a PackedLinear; returns how many. Layers
    already packed stay as they are, so packing a model twice changes nothing."""
    if not available():
        return 0
    shared = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and child.weight.device.type == "cpu"
        and child.weight.dtype in PACKED_DTYPES
        and child.weight.data_ptr() not in shared
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear.of(child))
    return len(swaps)
