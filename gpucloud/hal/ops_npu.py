"""npu (Ascend) implementations of the registry's ops: torch_npu's fused kernels.

Importable anywhere: torch_npu is imported only inside an op, and an op is chosen only where
torch_npu is installed, so a CPU machine lists this table without importing it. Shapes the
fused kernels do not take (see their constraints below) go to the reference.
"""

from __future__ import annotations

from gpucloud.hal import ops

NPU_ROTARY_HEAD_DIM = 128  # npu_rotary_mul takes 4-D inputs whose head_dim is a multiple of 128


@ops.register("rms_norm", backend="npu", name="npu_rms_norm", requires="torch_npu")
def rms_norm_npu(x, weight, eps):
    import torch_npu

    return torch_npu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]


@ops.register("rotary", backend="npu", name="npu_rotary_mul", requires="torch_npu")
def rotary_npu(x, cos, sin):
    """x [batch, seq, heads, dim] or [tokens, heads, dim]; cos, sin without the heads axis."""
    if x.shape[-1] % NPU_ROTARY_HEAD_DIM or x.dim() not in (3, 4):
        return ops.rotary(x, cos, sin)
    import torch_npu

    cos, sin = (t.unsqueeze(-2).to(x.dtype) for t in (cos, sin))
    if x.dim() == 3:  # [tokens, heads, dim] as a batch of one: [1, tokens, heads, dim]
        return torch_npu.npu_rotary_mul(x[None], cos[None], sin[None])[0]
    return torch_npu.npu_rotary_mul(x, cos, sin)
