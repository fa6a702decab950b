"""Weight-only int8/int4: GPTQ and AWQ checkpoints unpack to exactly the weights they encode,
the loaded model holds exactly the bytes the planner counts, and quantized logits and greedy
tokens stay close to fp32."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from quant_checkpoints import write_checkpoint
from safetensors.torch import load_file, save_file

from gpucloud.errors import ConfigError, UserError
from gpucloud.hal import ops
from gpucloud.models.loader import load_model, save_model
from gpucloud.models.quant import QUANTIZED
from gpucloud.models.quant_config import Quantization
from gpucloud.models.spec import ModelSpec
from gpucloud.models.tensor_parallel import Shard, check_tensor_parallel
from gpucloud.planner.inference import weights_bytes
from gpucloud.serve import LLM, SamplingParams, cpu_kernels

FORMATS = [("gptq", 32, False), ("gptq", 32, True), ("gptq_v2", 128, False), ("awq", 32, False),
           ("gptq", -1, False)]  # fmt: skip


def quantized_layers(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QUANTIZED)}


def allocated_bytes(model) -> int:
    """Bytes of every distinct storage behind the state dict (tied weights once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in model.state_dict().values()}  # fmt: skip
    return sum(storages.values())


@pytest.fixture(scope="module")
def checkpoints(tiny_dir: Path, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("quantized")
    paths = {f: root / "-".join(map(str, f)) for f in FORMATS}
    return {f: (path, write_checkpoint(tiny_dir, path, *f)) for f, path in paths.items()}


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f[0]}-g{f[1]}{'-act' * f[2]}")
def test_checkpoints_unpack_to_exactly_the_weights_they_encode(checkpoints, fmt):
    path, expected = checkpoints[fmt]
    model = load_model(path)
    layers = quantized_layers(model)
    assert sorted(layers) == sorted(expected) and len(layers) == 2 * 7  # 2 layers × 7 projections
    for name, layer in layers.items():
        assert torch.equal(layer.dequantized(), expected[name]), name
    assert (layers["model.layers.0.mlp.down_proj"].perm is not None) == fmt[2]


@pytest.mark.parametrize("shape", [(2, 24), (1, 4)], ids=["prefill", "decode-rows"])
@pytest.mark.parametrize("fmt", FORMATS[:2] + FORMATS[3:4], ids=["gptq", "gptq-act", "awq"])
def test_quantized_forward_is_the_fp_forward_of_the_dequantized_weights(
    checkpoints, tiny_dir, fmt, shape
):
    """A few rows go through the cpu backend's int4 kernel where it is built (it takes only
    contiguous buffers: checkpoint layers once held transposed ones, and decoding failed)."""
    cpu_kernels.build()
    path, expected = checkpoints[fmt]
    quantized, fp = load_model(path), load_model(tiny_dir)
    with torch.no_grad():
        for name, weight in expected.items():
            fp.get_submodule(name).weight.copy_(weight)
        ids = torch.randint(
            3, fp.spec.vocab_size, shape, generator=torch.Generator().manual_seed(1)
        )
        # Same weights, same math up to the order of fp32 sums (act-order permutes them).
        torch.testing.assert_close(quantized(ids), fp(ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("method", "dtype", "fmt"),
    [("int8", "float32", None), ("int4", "float32", None), ("int8", "bfloat16", None),
     ("int4", "bfloat16", None), ("int4", "float32", FORMATS[1]), ("int4", "float32", FORMATS[4]),
     (None, "float32", None)],
)  # fmt: skip
def test_planner_weight_bytes_are_what_the_loaded_model_allocates(
    tiny_dir, checkpoints, method, dtype, fmt
):
    path = checkpoints[fmt][0] if fmt else tiny_dir
    model = load_model(path, dtype, quantization=None if fmt else method)
    spec = ModelSpec.from_dir(path)
    dense = torch.empty((), dtype=model.model.embed_tokens.weight.dtype).element_size()
    planned = weights_bytes(spec, method or "fp32", dense)
    assert allocated_bytes(model) == planned
    if method:
        assert planned < 0.85 * weights_bytes(spec, "fp32", dense)


def test_planner_counts_every_expert_of_a_moe_model():
    spec = ModelSpec("moe", "mixtral", vocab_size=256, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    for method in ("int8", "int4"):
        model = _meta_model(replace(spec, quantization=Quantization(method)))
        layers = quantized_layers(model)
        assert len(layers) == 2 * (4 + 3 * 4)  # attention 4, experts 4 × 3; the router stays
        assert _meta_bytes(model) == weights_bytes(spec, method, 4)


def _meta_model(spec):
    from gpucloud.models.loader import _on_meta

    return _on_meta(spec)


def _meta_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


# ---- quality: logits and greedy tokens against fp32 ------------------------------------------
# The tiny preset's weights are normal(0, 0.02), so its logits span about ±1.5.
# int8 rounds each weight by at most half a step, max|w_row| / 254: ~0.4% of the largest
# weight of its row, so each projection's output moves by well under 1% and the logits by
# about that much of their range (measured: 0.006 of 1.46); the bound leaves 5x margin.
# int4 groups of 128 take 15 steps per group: the step is ~1/15 of the group's range, ~16x
# int8's (measured 0.08); bound with 2x margin. Greedy tokens flip only where fp32's two best
# logits are closer than the error: teacher-forced argmax agreement measured 100% (int8) and
# 99% (int4) over 256 positions.
BOUNDS = {"int8": (0.03, 0.99), "int4": (0.16, 0.95)}  # (max |Δlogit|, argmax agreement)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_logits_and_greedy_tokens_stay_close_to_fp32(tiny_dir, method):
    fp, quantized = load_model(tiny_dir), load_model(tiny_dir, quantization=method)
    ids = torch.randint(3, fp.spec.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = fp(ids), quantized(ids)
    max_err, min_agreement = BOUNDS[method]
    assert (a - b).abs().max() < max_err
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= min_agreement
    assert (a - b).abs().max() > 0  # the layers did quantize


def test_engine_serves_quantized_weights_with_greedy_tokens_of_fp32(tiny_dir):
    prompts = [[5, 17, 300, 42], list(range(100, 140))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    runs = {q: LLM(tiny_dir, quantization=q, kv_cache_bytes=1 << 22).generate(prompts, params)
            for q in (None, "int8")}  # fmt: skip
    fp, int8 = ([o.outputs[0].token_ids for o in runs[q]] for q in (None, "int8"))
    assert int8 == fp  # int8 moves no greedy token of this model (see BOUNDS)


# ---- ops and errors ----------------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 16, 17])
def test_the_cpu_int8_kernel_agrees_with_the_reference(rows):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 256, generator=gen).bfloat16()
    q = torch.randint(-127, 128, (96, 256), generator=gen, dtype=torch.int8)
    scales = (torch.rand(96, generator=gen) / 100).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    fast = ops.get("int8_linear", "cpu")(x, q, scales, bias)
    reference = ops.get("int8_linear", ops.REFERENCE)(x.float(), q, scales.float(), bias.float())
    torch.testing.assert_close(fast.float(), reference, rtol=2e-2, atol=2e-2)


def test_quantization_errors_are_one_line(tiny_dir, checkpoints, tmp_path):
    with pytest.raises(UserError, match="tiny has int8 weights: save the fp model"):
        save_model(load_model(tiny_dir, quantization="int8"), tmp_path / "saved")
    with pytest.raises(ConfigError, match="quantization 'int3' is not supported: use int8 or int4"):
        load_model(tiny_dir, quantization="int3")
    gptq = checkpoints[FORMATS[0]][0]
    with pytest.raises(ConfigError, match="is a gptq int4 checkpoint: it cannot be served with"):
        load_model(gptq, quantization="int8")
    assert quantized_layers(load_model(gptq, quantization="int4"))
    shuffled = tmp_path / "shuffled"
    write_checkpoint(tiny_dir, shuffled, "gptq", 32, act_order=True)
    config = json.loads((shuffled / "config.json").read_text())
    config["quantization_config"]["desc_act"] = False
    (shuffled / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"g_idx does not assign input channels to groups of 32"):
        load_model(shuffled)
    wrapped = tmp_path / "wrapped"
    shutil.copytree(gptq, wrapped)
    state = load_file(wrapped / "model.safetensors")
    state["model.layers.1.mlp.up_proj.qzeros"].fill_(-1)  # every nibble 15: zero 16 in v1
    save_file(state, wrapped / "model.safetensors")
    with pytest.raises(ConfigError, match="up_proj.qzeros holds zero point 16"):
        load_model(wrapped)


# (format, group size) whose groups tiny's row-parallel inputs split into: o_proj's 64 and
# down_proj's 176 give each of 2 ranks 32 and 88 inputs, 11 groups of 8 (an odd number, so
# the packed zero points are repacked), or one group spanning the row (GPTQ v1 as well: its
# zero points are stored minus one, and a group of 8 random weights often needs zero 0).
SPLITTABLE = [("gptq_v2", 8), ("awq", 8), ("gptq", -1)]


@pytest.mark.parametrize("fmt", SPLITTABLE, ids=lambda f: f"{f[0]}-g{f[1]}")
def test_each_tensor_parallel_rank_holds_its_slice_of_the_encoded_weights(tiny_dir, tmp_path, fmt):
    """GPTQ/AWQ under tensor parallelism: rank r's dequantized projection is exactly its
    slice of the whole one (output rows of q/k/v/gate/up, input columns of o/down, with
    their groups)."""
    expected = write_checkpoint(tiny_dir, tmp_path / "q", *fmt)
    check_tensor_parallel(ModelSpec.from_dir(tmp_path / "q"), 2)
    for rank in range(2):
        layers = quantized_layers(load_model(tmp_path / "q", shard=Shard(rank, 2)))
        assert sorted(layers) == sorted(expected)
        for name, layer in layers.items():
            whole = expected[name]
            dim = 1 if name.endswith(("o_proj", "down_proj")) else 0
            part = whole.shape[dim] // 2
            assert torch.equal(layer.dequantized(), whole.narrow(dim, rank * part, part)), name


def test_tensor_parallel_refuses_act_order_and_split_groups(checkpoints):
    with pytest.raises(ConfigError, match="act-order .desc_act.: its groups are scattered"):
        check_tensor_parallel(ModelSpec.from_dir(checkpoints[FORMATS[1]][0]), 2)
    with pytest.raises(ConfigError, match="splits the 176 inputs of down_proj into 88 per rank, "
                       "not a multiple of the gptq group size 32") as e:  # fmt: skip
        check_tensor_parallel(ModelSpec.from_dir(checkpoints[FORMATS[0]][0]), 2)
    assert "\n" not in str(e.value)
