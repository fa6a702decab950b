"""Multi-LoRA serving: PEFT adapters chosen per request give transformers + PEFT's tokens and
logprobs, with adapters and the base model mixed in one step, adapters swapped through too
few slots, and a prefix cache that never hands one adapter's KV blocks to another."""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch
from lora_helpers import ALL_TARGETS, make_peft_adapter, peft_model

from gpucloud.errors import ConfigError, NotFoundError, UserError
from gpucloud.models.loader import load_model
from gpucloud.models.lora import load_adapter
from gpucloud.serve import EngineConfig, LLMEngine, LoRARequest, SamplingParams

TOLERANCE = 1e-9  # float64 on both sides: only summation order differs
SAMPLED_TOLERANCE = 1e-5  # the sampler's logits are fp32 whatever the model's dtype
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    """Our tiny model in float64 (no argmax can flip with the batch's shape)."""
    return load_model(tiny_model_dir).double()


@pytest.fixture(scope="module")
def prompts(base) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, base.spec.vocab_size, (n,), generator=gen).tolist()
            for n in (9, 30, 17)]  # fmt: skip


@pytest.fixture(scope="module")
def reference(tiny_model_dir, lora_dirs):
    """(adapter name or None, token ids) -> transformers + PEFT's log-softmax at every
    position, fp64."""

    @functools.cache
    def model(name):
        return peft_model(tiny_model_dir, lora_dirs[name] if name else None, torch.float64)

    def log_softmax(name, ids):
        with torch.inference_mode():
            return model(name)(torch.tensor([ids])).logits[0].log_softmax(-1)

    return log_softmax


def _engine(base, **config) -> LLMEngine:
    import copy

    config = {"kv_cache_bytes": 1 << 22, "block_size": 4, "enable_lora": True, **config}
    return LLMEngine(copy.deepcopy(base), None, EngineConfig(**config))


def _check(out, prompt, adapter, reference, scored_prompt: bool) -> None:
    """Greedy tokens are the reference's argmax and every logprob its log-softmax."""
    c = out.outputs[0]
    assert len(c.token_ids) == NEW_TOKENS
    lp = reference(adapter, prompt + c.token_ids)
    for j, (token, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        row = lp[len(prompt) - 1 + j]
        assert token == int(row.argmax())
        assert abs(entry.logprob - float(row[token])) < SAMPLED_TOLERANCE
    if scored_prompt:
        for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
            assert abs(entry.logprob - float(lp[i - 1][prompt[i]])) < TOLERANCE


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
SCORED = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1,
                        prompt_logprobs=1)  # fmt: skip


def test_two_adapters_and_the_base_in_one_step_match_peft(base, prompts, lora_dirs, reference):
    engine = _engine(base, max_loras=2)
    for name, path in lora_dirs.items():
        engine.add_lora(name, path)
    mix = [(prompts[0], "alpha"), (prompts[0], None), (prompts[1], "beta"), (prompts[2], "alpha")]
    ids = [engine.add_request(p, SCORED, lora_request=a) for p, a in mix]
    first = {o.request_id: o for o in engine.step()}
    # One step is one forward: every request, of either adapter or none, got its first token.
    assert sorted(first) == sorted(ids)
    assert all(len(o.outputs[0].token_ids) == 1 for o in first.values())
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    for rid, (prompt, adapter) in zip(ids, mix, strict=True):
        _check(done[rid], prompt, adapter, reference, scored_prompt=True)
    # The adapters matter: the same prompt, another first token distribution.
    alpha, plain = (done[rid].prompt_logprobs[-1].logprob for rid in ids[:2])
    assert abs(alpha - plain) > 1e-2


def test_one_slot_serves_adapters_in_turn(base, prompts, lora_dirs, reference):
    engine = _engine(base, max_loras=1)
    mix = [(prompts[1], "alpha"), (prompts[1], "beta"), (prompts[2], None), (prompts[2], "alpha")]
    ids = []
    for prompt, adapter in mix:
        lora = adapter and LoRARequest(adapter, 1, str(lora_dirs[adapter]))  # loaded on first use
        ids.append(engine.add_request(prompt, GREEDY, lora_request=lora))
    adapter_of = dict(zip(ids, (a for _, a in mix), strict=True))
    done = {}
    while engine.has_unfinished():
        outs = engine.step()
        assert len({adapter_of[o.request_id] for o in outs} - {None}) <= 1
        done |= {o.request_id: o for o in outs if o.finished}
    for rid, (prompt, adapter) in zip(ids, mix, strict=True):
        _check(done[rid], prompt, adapter, reference, scored_prompt=False)


def test_prefix_cache_is_kept_per_adapter(base, prompts, lora_dirs, reference):
    engine = _engine(base)
    for name, path in lora_dirs.items():
        engine.add_lora(name, path)
    prompt = prompts[1]
    cached = []
    for adapter in ("alpha", None, "beta", "alpha", None):
        out = _run(engine, prompt, adapter)
        _check(out, prompt, adapter, reference, scored_prompt=False)
        cached.append(out.num_cached_tokens)
    assert cached[:3] == [0, 0, 0]  # the same tokens under another adapter: nothing shared
    assert cached[3] > 0 and cached[4] > 0  # under the same one: reused


def _run(engine, prompt, adapter):
    rid = engine.add_request(prompt, GREEDY, lora_request=adapter)
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    return done[rid]


def test_adapter_names_and_loading_errors(base, lora_dirs):
    engine = _engine(base)
    engine.add_lora("alpha", lora_dirs["alpha"])
    with pytest.raises(UserError, match="already loaded"):
        engine.add_lora("alpha", lora_dirs["beta"])
    with pytest.raises(NotFoundError, match="unknown LoRA adapter 'alpah': did you mean alpha"):
        engine.add_request([1, 2, 3], GREEDY, lora_request="alpah")
    engine.remove_lora("alpha")
    assert engine.list_loras() == []
    plain = LLMEngine(base, None, EngineConfig(kv_cache_bytes=1 << 22))
    with pytest.raises(ConfigError, match="enable_lora=True"):
        plain.add_request([1, 2, 3], GREEDY, lora_request="alpha")


def _edited(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps(config | changes))
    return dst


def test_unsupported_adapters_fail_to_load_with_one_line(tiny_model_dir, base, lora_dirs, tmp_path):
    spec, alpha = base.spec, lora_dirs["alpha"]
    cases = [
        (alpha, 4, "rank 8: the server takes ranks 1..4 (raise --max-lora-rank)"),
        (_edited(alpha, tmp_path / "dora", use_dora=True), 16, "sets use_dora=True: not supported"),
        (_edited(alpha, tmp_path / "ia3", peft_type="IA3"), 16, "PEFT type 'IA3': only LORA"),
        (tmp_path, 16, "no adapter_config.json"),
    ]
    embed = make_peft_adapter(tiny_model_dir, tmp_path / "embed", 0, r=4,
                              target_modules=["embed_tokens", "q_proj"])  # fmt: skip
    cases.append((embed, 16, "targets embed_tokens: LoRA is served on q_proj, k_proj"))
    for path, max_rank, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)) as e:
            load_adapter(path, spec, max_rank, "x")
        assert "\n" not in str(e.value)


def test_an_adapter_of_another_base_model_is_refused(tmp_path, base):
    import peft
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=1, num_attention_heads=2)  # fmt: skip
    other = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=4, target_modules=ALL_TARGETS, init_lora_weights=False)
    peft.get_peft_model(other, lora).save_pretrained(tmp_path / "other")
    message = "does not fit this base model: layers.0.mlp.down_proj.lora_A is [4, 48], the model "
    message += "needs [4, 176]"
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_adapter(tmp_path / "other", base.spec, 16, "other")
