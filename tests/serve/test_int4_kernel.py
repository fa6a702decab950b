"""The cpu int4 kernel reads packed nibbles and gives what dequantizing the weight gives."""

from __future__ import annotations

import pytest
import torch

from gpucloud.hal import ops
from gpucloud.models.loader import load_model
from gpucloud.models.quant import quantize_int4
from gpucloud.serve import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.build(), reason="no C++ toolchain")


@pytest.mark.parametrize(
    ("out", "cols", "group", "rows"),
    [(48, 256, 128, 1), (40, 320, 128, 3), (33, 96, 96, 16), (24, 200, 64, 5)],
)  # whole groups; a short last group and an odd count of groups; one group per row
def test_the_kernel_matches_the_dequantized_reference(out, cols, group, rows):
    gen = torch.Generator().manual_seed(out)
    buffers = quantize_int4(torch.randn(out, cols, generator=gen), group, torch.float32)
    x = torch.randn(rows, cols, generator=gen)
    bias = torch.randn(out, generator=gen)
    args = (buffers["qweight"], buffers["scales"], buffers["zeros"], group, bias)
    got = ops.get("int4_linear", "cpu")(x, *args)
    want = ops.int4_linear(x, *args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_int4_model_gives_the_reference_logits(tiny_model_dir):
    """Decode-sized batches take the kernel; the logits stay within 1e-4 of the reference's
    (dequantize, then matmul: the same weights, summed in another order)."""
    ids = torch.tensor([[5, 9, 2, 7, 11, 3]])
    with ops.using(ops.REFERENCE):
        reference = load_model(tiny_model_dir, quantization="int4")
    model = load_model(tiny_model_dir, quantization="int4")
    assert model.model.layers[0].mlp.up_proj._op is cpu_kernels.int4_linear
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), reference(ids), rtol=0, atol=1e-4)
