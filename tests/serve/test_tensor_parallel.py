"""Tensor parallelism: two ranks (this process and a worker, over gloo) give the tokens of
one, on tiny models of the supported families built by transformers; each rank holds what
the planner says it holds; bad splits are refused before any process starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hf_families import ROWS, VOCAB, build
from quant_checkpoints import write_checkpoint
from serve_helpers import run_engine

from gpucloud import hardware
from gpucloud.errors import ConfigError
from gpucloud.models.draft import first_layers
from gpucloud.models.llama import LlamaForCausalLM
from gpucloud.models.loader import load_model, save_model
from gpucloud.models.presets import PRESETS
from gpucloud.models.spec import ModelSpec
from gpucloud.planner import ServeSetup, estimate_inference
from gpucloud.serve import EngineConfig, LLMEngine, LoRARequest, SamplingParams, cpu_linear, tp
from gpucloud.serve.spec_policy import GuessPolicy

NEW_TOKENS = 8
LOGPROB_ATOL = 1e-9  # float64 on both sides: only summation order differs
_gen = torch.Generator().manual_seed(11)
LONG = torch.randint(3, VOCAB - 1, (70,), generator=_gen).tolist()
PROMPTS = [LONG[:5], LONG, LONG[:40] + torch.randint(3, VOCAB - 1, (21,), generator=_gen).tolist()]
# (row, vocabulary): 255 does not divide by 2, so the last rank's vocabulary rows are padded.
CASES = {
    "llama-linear-bias-head_dim": VOCAB,  # GQA, q/k/v/o biases (o's is row-parallel), head_dim
    "qwen2-tied": VOCAB - 1,  # q/k/v biases, tied embeddings
    "qwen3-head_dim-tied": VOCAB,  # qk-norm
    "mixtral-moe": VOCAB,  # experts split by columns, router whole
}


def tp_engine(model_dir: Path, draft=None, **config) -> LLMEngine:
    """An engine over `tensor_parallel_size` ranks of `model_dir` (token ids in, no tokenizer:
    the transformers-built directories have none)."""
    config = EngineConfig(**config)
    model, workers = tp.start(model_dir, config)
    return LLMEngine(model, None, tp.rank_config(config), draft, workers=workers)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module", params=CASES, ids=str)
def model_dir(request, tmp_path_factory) -> Path:
    row = {r.name: r for r in ROWS}[request.param]
    out = tmp_path_factory.mktemp(row.name) / "hf"
    build(row, out, vocab=CASES[row.name])
    return out


def test_two_ranks_give_the_tokens_of_one(model_dir):
    # a pool that holds the longest request alone (preemptions), chunked prefill, prefix cache
    spec = ModelSpec.from_dir(model_dir)
    pool = int(spec.kv_bytes_per_token(8)) * (len(LONG) + NEW_TOKENS + 8)
    config = dict(dtype="float64", block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    one = LLMEngine(load_model(model_dir, "float64"), None,
                    EngineConfig(kv_cache_bytes=pool, **config))  # fmt: skip
    two = tp_engine(model_dir, kv_cache_bytes=pool // 2, tensor_parallel_size=2, **config)
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=3,
                             prompt_logprobs=2 if i == 1 else None)
              for i in range(len(PROMPTS))]  # fmt: skip
    try:
        assert two.blocks.num_blocks == one.blocks.num_blocks  # each rank: half the KV heads
        want, got = run_engine(one, PROMPTS, params), run_engine(two, PROMPTS, params)
        for w, g in zip(want, got, strict=True):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            _assert_close(g.outputs[0].logprobs, w.outputs[0].logprobs)
        _assert_close(got[1].prompt_logprobs[1:], want[1].prompt_logprobs[1:])
        assert len(got[1].prompt_logprobs) == len(LONG)
        for stats in (one.stats(), two.stats()):
            assert stats.num_preemptions > 0 and stats.prefix_cache_hit_rate > 0
        _assert_planner_sizes(two, spec)
    finally:
        two.shutdown()
    assert not any(_alive(pid) for pid in two.workers.pids)


def _assert_close(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.top.keys() == w.top.keys()
        for token, value in w.top.items():
            assert abs(g.top[token] - value) < LOGPROB_ATOL


def _assert_planner_sizes(engine: LLMEngine, spec: ModelSpec) -> None:
    """Each rank's weights and KV cache, as allocated, are the planner's per-GPU figures
    (the planner counts 4-byte fp32 weights; these ranks hold float64)."""
    setup = ServeSetup(hardware.get("L40S"), quant="fp32", tp=2)
    memory = estimate_inference(spec, setup).memory
    cache_tokens = engine.blocks.num_blocks * engine.blocks.block_size
    for weights, cache in engine.runner.rank_memory():
        assert weights == 2 * memory.weights_per_gpu_bytes
        assert cache == 2 * memory.kv_bytes_per_token_per_gpu * cache_tokens


def test_a_split_that_does_not_divide_is_refused_before_any_process_starts(tiny_model_dir):
    heads = ModelSpec.from_dir(tiny_model_dir).num_attention_heads
    with pytest.raises(ConfigError, match=f"does not divide the {heads} attention heads") as e:
        tp.start(tiny_model_dir, EngineConfig(tensor_parallel_size=heads + 1))
    assert "use one of" in str(e.value) and "\n" not in str(e.value)
    assert not _worker_children()


def _worker_children() -> list[int]:
    """This process's tensor-parallel worker processes (running or not yet reaped)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat.split(") ")[1].split()[1]) == os.getpid() and b"tp_worker" in cmdline:
            pids.append(int(entry.name))
    return pids


def test_each_rank_packs_its_own_shard_and_gives_the_unpacked_tokens(tmp_path):
    """fp32 projections are oneDNN-packed by each rank's runner after the split (float64 is
    never packed: it is the reference here), biases of row-parallel layers included."""
    row = {r.name: r for r in ROWS}["llama-linear-bias-head_dim"]
    build(row, tmp_path)
    config = dict(block_size=4, kv_cache_bytes=1 << 20)
    one = LLMEngine(load_model(tmp_path, "float64"), None, EngineConfig(dtype="float64", **config))
    two = tp_engine(tmp_path, dtype="float32", tensor_parallel_size=2, **config)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    try:
        attention = two.model.model.layers[0].self_attn
        assert isinstance(attention.q_proj, cpu_linear.PackedLinear)
        assert isinstance(attention.o_proj, cpu_linear.PackedLinear)
        spec = ModelSpec.from_dir(tmp_path)
        assert attention.q_proj.out_features == spec.num_attention_heads // 2 * spec.head_dim
        want, got = run_engine(one, PROMPTS, params), run_engine(two, PROMPTS, params)
        assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    finally:
        two.shutdown()


def test_lora_adapters_on_two_ranks_give_the_tokens_of_one(tiny_model_dir, lora_dirs):
    """PEFT adapters under tensor parallelism: each rank holds its part of every adapter (B's
    rows on q/k/v/gate/up, A's columns on o/down); requests of two adapters and of the base
    model, through one slot (every adapter change reloads it on both ranks), one added by
    name and one by path on first use, give the tokens and logprobs of one rank."""
    config = dict(dtype="float64", block_size=4, kv_cache_bytes=1 << 22, enable_lora=True,
                  max_loras=1, max_num_seqs=4)  # fmt: skip
    one = LLMEngine(load_model(tiny_model_dir, "float64"), None, EngineConfig(**config))
    two = tp_engine(tiny_model_dir, tensor_parallel_size=2, **config)
    mix = [(PROMPTS[0], "alpha"), (PROMPTS[1], None), (PROMPTS[2], "beta"), (PROMPTS[1], "alpha")]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    try:
        outputs = []
        for engine in (one, two):
            engine.add_lora("alpha", lora_dirs["alpha"])
            beta = LoRARequest("beta", 2, str(lora_dirs["beta"]))
            ids = [engine.add_request(p, params, lora_request=beta if a == "beta" else a)
                   for p, a in mix]  # fmt: skip
            done = {}
            while engine.has_unfinished():
                done |= {o.request_id: o for o in engine.step() if o.finished}
            outputs.append([done[i].outputs[0] for i in ids])
        want, got = outputs
        for w, g in zip(want, got, strict=True):
            assert g.token_ids == w.token_ids
            _assert_close(g.logprobs, w.logprobs)
        # the adapters change the tokens: the base model's request differs from alpha's
        assert want[1].token_ids != want[3].token_ids
    finally:
        two.workers.stop()


def test_a_draft_model_on_the_driver_keeps_two_ranks_tokens(tmp_path):
    """Draft-model speculation under tensor parallelism: the draft runs whole on the driver,
    the target's verification forward on both ranks; greedy tokens are one rank's without
    speculation, and guesses were both accepted and rejected."""
    target = LlamaForCausalLM(PRESETS["tiny"])
    target.init_weights(0, std=0.1)  # a 1-layer draft is right often, not always
    model_dir = save_model(target, tmp_path / "tiny")
    draft = first_layers(load_model(model_dir, "float64"), 1)
    config = dict(dtype="float64", block_size=4, kv_cache_bytes=1 << 22)
    one = LLMEngine(load_model(model_dir, "float64"), None, EngineConfig(**config))
    two = tp_engine(model_dir, tensor_parallel_size=2, speculative="draft",
                    num_speculative_tokens=4, draft=draft, **config)  # fmt: skip
    two.guess_policy = GuessPolicy(4, draft_cost=0.0)  # keep guessing: the draft is priced free
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    try:
        want, got = run_engine(one, PROMPTS, params), run_engine(two, PROMPTS, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        stats = two.stats()
        assert 0 < stats.accepted_tokens < stats.draft_tokens
    finally:
        two.workers.stop()


def test_a_gptq_checkpoint_on_two_ranks_gives_the_tokens_of_one(tiny_model_dir, tmp_path):
    """A GPTQ (v2, groups of 8) checkpoint split over two ranks: each rank unpacks the whole
    projection and keeps its part, groups included; greedy tokens and logprobs are one
    rank's (fp32: the ranks' all-reduce sums in another order)."""
    write_checkpoint(tiny_model_dir, tmp_path / "gptq", "gptq_v2", 8)
    config = dict(block_size=4, kv_cache_bytes=1 << 22)
    one = LLMEngine(load_model(tmp_path / "gptq"), None, EngineConfig(**config))
    two = tp_engine(tmp_path / "gptq", tensor_parallel_size=2, **config)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    try:
        want, got = run_engine(one, PROMPTS, params), run_engine(two, PROMPTS, params)
        for w, g in zip(want, got, strict=True):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
                assert all(abs(a.top[t] - b.top[t]) < 1e-4 for t in b.top)
    finally:
        two.workers.stop()
