"""oneDNN-packed projections: the same outputs as nn.Linear, and a packed model still saves,
copies and packs again as a plain one would."""

from __future__ import annotations

import copy

import pytest
import torch
from serve_helpers import random_model
from torch import nn

from gpucloud.serve import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_linear_computes_what_the_plain_one_does(dtype):
    torch.manual_seed(0)
    plain = nn.Linear(96, 80, bias=True).to(dtype)
    packed = cpu_linear.PackedLinear.of(plain)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for shape in [(1, 96), (7, 96), (2, 5, 96), (0, 96)]:
        x = torch.randn(shape, dtype=dtype)
        torch.testing.assert_close(packed(x), plain(x), atol=tol, rtol=tol)
    assert torch.equal(packed.weight, plain.weight)


def test_a_packed_model_keeps_its_state_dict_and_copies():
    model = random_model("tiny", torch.float32)  # its LM head is tied to the embedding
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[5, 9, 2, 7]])
    with torch.inference_mode():
        logits = model(ids)
    assert cpu_linear.pack_linears(model) == 7 * model.spec.num_hidden_layers
    assert cpu_linear.pack_linears(model) == 0  # packed once only
    assert type(model.lm_head) is nn.Linear  # the embedding lookup needs the plain layout
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    twin = copy.deepcopy(model)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(twin(ids), logits, atol=1e-4, rtol=1e-4)


def test_an_untied_head_is_packed_too():
    model = random_model("tiny", torch.float32)
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    assert cpu_linear.pack_linears(model) == 7 * model.spec.num_hidden_layers + 1
    assert isinstance(model.lm_head, cpu_linear.PackedLinear)
