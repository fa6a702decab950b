"""Every op implementation this machine can run, against the reference, over dtypes and odd
shapes (head dims 72/80, odd lengths, batch 1, grouped KV heads, sliding windows); and the
`gpucloud hal ops` listing."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from typer.testing import CliRunner

from gpucloud.cli.main import _app
from gpucloud.hal import device, ops
from gpucloud.serve import cpu_kernels

GPUCLOUD = str(Path(sys.executable).with_name("gpucloud"))
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rtol, atol) of an implementation against the reference computed in the same dtype: a
# reordered fp32 sum, or one rounding of the 16-bit result apart.
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


class Shape(NamedTuple):
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None


SHAPES = [
    Shape(1, 7, 4, 4, 72, None),  # batch 1, odd length, head dim 72
    Shape(3, 13, 6, 2, 80, None),  # grouped KV heads, head dim 80
    Shape(2, 11, 8, 1, 64, 5),  # multi-query, sliding window shorter than the sequence
]
BLOCK = 4


def _inputs(op: str, s: Shape, dtype: torch.dtype, dev) -> Callable[[Callable], torch.Tensor]:
    """`run(fn)`: fn applied to seeded inputs of `op` (the same, fresh, on each call)."""
    return lambda fn: _case(op, s, dtype, dev)(fn)


def _case(op: str, s: Shape, dtype: torch.dtype, dev) -> Callable[[Callable], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(dev, dt)

    b, n, h, kv, d, w = s
    hidden = h * d
    blocks = b * -(-n // BLOCK) + 3
    cache = (rand(kv, blocks, BLOCK, d), rand(kv, blocks, BLOCK, d))
    order = torch.randperm(blocks, generator=gen)[: b * -(-n // BLOCK)].view(b, -1).to(dev)
    lengths = torch.tensor([n - i for i in range(b)], device=dev)
    x, cos = rand(b, n, h, d), rand(b, n, d, dt=torch.float32)
    q, k, v = rand(b, n, h, d), rand(b, n, kv, d), rand(b, n, kv, d)
    qweight = torch.randint(-127, 128, (hidden + 3, hidden), generator=gen, dtype=torch.int8)
    q4 = torch.randint(0, 256, (hidden + 3, hidden // 2), generator=gen, dtype=torch.uint8)
    group = 32
    groups = -(-hidden // group)
    scales4 = rand(hidden + 3, groups).abs() * 0.01
    zeros4 = torch.randint(0, 256, (hidden + 3, -(-groups // 2)), generator=gen,
                           dtype=torch.uint8)  # fmt: skip
    rows = rand(b, hidden)
    scale = d**-0.5
    tokens = rand(b * n, hidden)
    lora = (rand(b * n, hidden + 3), tokens, rand(3, 8, hidden), rand(3, hidden + 3, 8))
    everyone = torch.arange(b * n, device=dev)
    # One adapter for the whole batch, or two for some tokens and none for the rest.
    lora_groups = [(1, everyone)] if b == 1 else [(2, everyone[::2]), (0, everyone[1:2])]
    vocab, n_rows = hidden + 3, b * n  # an odd vocabulary
    ks = [5, 17, vocab if b == 3 else 40]  # b 3: some rows without top-k (a full sort)
    top_k = torch.tensor([ks[i % 3] for i in range(n_rows)], device=dev)
    top_p = torch.tensor([(0.9, 1.0, 0.5)[i % 3] for i in range(n_rows)], device=dev, dtype=dtype)
    min_p = torch.tensor([(0.0, 0.05, 0.0)[i % 3] for i in range(n_rows)], device=dev, dtype=dtype)
    cases = {
        # what survives is compared as the distribution drawn from (-inf becomes 0)
        "top_k_top_p": lambda f: f(rand(n_rows, vocab) * 3, top_k, top_p, min_p).softmax(-1),
        "rms_norm": lambda f: f(rand(b, n, hidden), rand(hidden), 1e-6),
        "silu_and_mul": lambda f: f(rand(b, n, hidden), rand(b, n, hidden)),
        "rotary": lambda f: f(x, cos, cos.flip(-1)),
        "causal_attention": lambda f: f(q, k, v, window=w),
        "document_attention": lambda f: f(q, k, v, torch.arange(n, device=dev).expand(b, n) // 3),
        "write_kv_cache": lambda f: _written(f, q[0, :, :kv], k[0], cache, order, dev),
        "paged_attention_decode": lambda f: f(q[:, 0], *cache, order, lengths, scale, w),
        "paged_attention_prefill": lambda f: f(q[0, : n - 3], *cache, order[0], 3, scale, w),
        "prefill_attention": lambda f: f(q[0], k[0], v[0], scale, w),
        "int8_linear": lambda f: f(
            rows, qweight.to(dev), rand(hidden + 3).abs() * 0.01, rand(hidden + 3)
        ),  # fmt: skip
        "int4_linear": lambda f: f(
            rows, q4.to(dev), scales4, zeros4.to(dev), group, rand(hidden + 3)
        ),  # fmt: skip
        "lora_add": lambda f: f(lora[0].clone(), *lora[1:], lora_groups),
    }
    return cases[op]


def _written(write, k, v, cache, table, dev) -> torch.Tensor:
    """The caches after writing k, v at the slots of the first sequence's blocks."""
    k_cache, v_cache = (c.clone() for c in cache)
    slots = (table[0][:, None] * BLOCK + torch.arange(BLOCK, device=dev)).flatten()[: len(k)]
    write(k, v, k_cache, v_cache, slots)
    return torch.stack((k_cache, v_cache))


def _present_impls() -> list[ops.Impl]:
    return [
        impl
        for backend in device.available()
        for op in ops.op_names()
        for impl in ops.implementations(op, backend)
    ]


@pytest.fixture(scope="module", autouse=True)
def cpu_kernel_built():
    """The cpu decode kernel is one of this machine's implementations once it is built."""
    assert cpu_kernels.build(), "the cpu paged-attention kernel does not build here"


def test_every_op_has_inputs_its_reference_runs_on():
    """So that any implementation registered later is compared here too."""
    for op in ops.op_names():
        for shape in SHAPES:
            out = _inputs(op, shape, torch.bfloat16, "cpu")(ops.get(op, ops.REFERENCE))
            assert out.dtype == torch.bfloat16 and out.isfinite().all()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", _present_impls(), ids=lambda i: f"{i.backend}-{i.name}")
def test_implementation_matches_the_reference(impl: ops.Impl, dtype, shape: Shape):
    assert impl.available(), f"{impl.name} cannot run on this machine"
    dev = device.device(0, device.get_backend(impl.backend))
    run = _inputs(impl.op, shape, dtype, dev)
    got, want = run(impl.fn), run(ops.get(impl.op, ops.REFERENCE))
    assert got.dtype == want.dtype and got.shape == want.shape
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


def test_the_cpu_backend_chooses_its_kernels_and_the_reference_elsewhere():
    cpu = ops.table("cpu")
    assert cpu["paged_attention_decode"] == "cpp-paged-decode"  # built by the fixture
    assert cpu["int8_linear"] == "torch-int8pack" and cpu["rms_norm"] == ops.REFERENCE
    assert cpu["top_k_top_p"] == "partial-topk"
    assert set(ops.table(ops.REFERENCE).values()) == {ops.REFERENCE}
    assert ops.get("paged_attention_decode", "cpu") is cpu_kernels.paged_attention_decode


def test_npu_table_is_listed_without_importing_torch_npu():
    code = (
        "import sys; from gpucloud.hal import ops; t = ops.table('npu'); "
        "names = [i.name for i in ops.implementations('rms_norm', 'npu')]; "
        "assert names == ['npu_rms_norm'] and t['rms_norm'] == 'reference', (names, t); "
        "assert 'torch_npu' not in sys.modules and 'flash_attn' not in sys.modules; "
        "ops.table('cuda'); assert 'flash_attn' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_using_reference_builds_models_on_reference_ops():
    from gpucloud.models.llama import RMSNorm

    with ops.using(ops.REFERENCE):
        assert ops.get("int8_linear") is ops.int8_linear
        assert RMSNorm(8, 1e-6)._op is ops.rms_norm
    assert ops.get("int8_linear", "cpu") is ops.int8_linear_cpu


def test_hal_ops_json_lists_each_backend_and_its_candidates():
    done = CliRunner().invoke(_app, ["hal", "ops", "--json"])
    assert done.exit_code == 0, done.output
    backends = json.loads(done.stdout)["backends"]
    assert set(backends) == set(device.BACKENDS)
    assert backends["cpu"]["present"] is True
    decode = backends["cpu"]["ops"]["paged_attention_decode"]
    assert decode == {"uses": "cpp-paged-decode",
                      "candidates": [{"name": "cpp-paged-decode", "available": True}]}  # fmt: skip
    npu_norm = backends["npu"]["ops"]["rms_norm"]
    assert npu_norm["uses"] == "reference" and npu_norm["candidates"][0]["available"] is False
    one = CliRunner().invoke(_app, ["hal", "ops", "--backend", "cpu", "--op", "int8_linear",
                                    "--json"])  # fmt: skip
    int8 = {"uses": "torch-int8pack", "candidates": [{"name": "torch-int8pack", "available": True}]}
    cpu = {"present": True, "ops": {"int8_linear": int8}}
    assert json.loads(one.stdout) == {"backends": {"cpu": cpu}}


def test_hal_ops_table_names_each_backends_choice():
    out = CliRunner().invoke(_app, ["hal", "ops", "--backend", "npu"]).stdout
    assert "npu (absent)" in out
    assert "reference (not here: npu_rms_norm)" in out
    cpu = CliRunner().invoke(_app, ["hal", "ops", "--backend", "cpu"]).stdout
    assert "int8_linear" in cpu and "torch-int8pack" in cpu


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "nup"], "error: unknown backend 'nup': did you mean npu?"),
        (["--op", "rms"], "error: unknown op 'rms': did you mean rms_norm?"),
    ],
)
def test_unknown_backend_or_op_is_one_line_exit_2(args, message):
    done = subprocess.run([GPUCLOUD, "hal", "ops", *args], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == message and done.stderr.count("\n") == 1
