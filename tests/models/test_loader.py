import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from gpucloud.errors import ConfigError, NotFoundError, UserError
from gpucloud.models import PRESETS, ModelSpec
from gpucloud.models.loader import init_model_dir, load_model, save_model

# Untied, GQA, qkv bias and Llama-3 RoPE scaling: the paths `tiny` does not take.
QWEN = ModelSpec("qwen-toy", "qwen2", vocab_size=600, hidden_size=64, intermediate_size=96,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                 attention_bias=True, rms_norm_eps=1e-6)  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
LLAMA3 = replace(
    PRESETS["tiny"], name="llama3-toy", tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE
)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


def _hf_logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return hf(ids).logits


def _mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose memory mapping holds `tensor`'s data, from /proc/self/maps."""
    ptr = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= ptr < end:
            return fields[5] if len(fields) > 5 else None
    return None


def test_transformers_loads_the_dir_unchanged_with_equal_logits(tiny_dir: Path):
    ids = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(1))
    initializers = torch.nn.init.normal_, torch.nn.init.kaiming_uniform_
    ours = load_model(tiny_dir)
    assert (torch.nn.init.normal_, torch.nn.init.kaiming_uniform_) == initializers  # restored
    assert torch.equal(_logits(ours, ids), _hf_logits(tiny_dir, ids))
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # tied again after assign


@pytest.mark.parametrize("spec", [QWEN, LLAMA3, PRESETS["tiny-moe"]], ids=lambda s: s.name)
def test_untied_biased_and_scaled_variants_match_transformers(tmp_path: Path, spec: ModelSpec):
    """Qwen2 biases, Llama 3 rope scaling and a Mixtral (tiny-moe: 4 experts, top 2), written
    by `init_model_dir` and read by transformers' own classes."""
    model_dir = init_model_dir(spec, tmp_path / spec.name, seed=3)
    ids = torch.randint(0, 600, (1, 80), generator=torch.Generator().manual_seed(2))
    ours = load_model(model_dir)
    assert ("lm_head.weight" in load_file(model_dir / "model.safetensors")) == (
        not spec.tie_word_embeddings
    )
    assert AutoModelForCausalLM.from_pretrained(model_dir).config.architectures == [
        spec.architecture
    ]
    torch.testing.assert_close(_logits(ours, ids), _hf_logits(model_dir, ids), rtol=0, atol=1e-5)


def test_weights_stay_memory_mapped_at_the_stored_dtype(tiny_dir: Path):
    file = str((tiny_dir / "model.safetensors").resolve())
    weight = load_model(tiny_dir).model.layers[0].mlp.up_proj.weight
    assert _mapped_file(weight) == file
    converted = load_model(tiny_dir, dtype="bfloat16").model.layers[0].mlp.up_proj.weight
    assert converted.dtype == torch.bfloat16 and _mapped_file(converted) != file
    assert torch.equal(converted, weight.to(torch.bfloat16))


def test_sharded_save_then_load_is_equal(tiny_dir: Path, tmp_path: Path):
    model = load_model(tiny_dir)
    out = save_model(model, tmp_path / "sharded", max_shard_bytes=150_000, tokenizer_dir=tiny_dir)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and set(index["weight_map"].values()) == {s.name for s in shards}
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once
    for shard in shards:  # only a tensor larger than the limit may exceed it, alone
        tensors = load_file(shard)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 150_000 or len(tensors) == 1
    assert index["metadata"]["total_size"] == 4 * PRESETS["tiny"].num_params
    loaded = load_model(out)
    for (key, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), key
    ids = torch.arange(40).view(1, 40)
    assert torch.equal(_hf_logits(out, ids), _logits(model, ids))
    assert (out / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()

    save_model(model, out)  # a later single-file save replaces the shards
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]


def test_bfloat16_save_and_config_dtype(tiny_dir: Path, tmp_path: Path):
    model = load_model(tiny_dir, dtype=torch.bfloat16)
    out = save_model(model, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (out / "model.safetensors").stat().st_size < (
        tiny_dir / "model.safetensors"
    ).stat().st_size
    assert all(t.dtype == torch.bfloat16 for t in load_file(out / "model.safetensors").values())
    for a, b in zip(model.parameters(), load_model(out, dtype="bf16").parameters(), strict=True):
        assert torch.equal(a, b)


def test_init_is_deterministic_per_seed(tmp_path: Path, tiny_dir: Path):
    again = init_model_dir("tiny", tmp_path / "again", seed=0, dtype="float16")
    other = init_model_dir("tiny", tmp_path / "other", seed=1)
    a, b, c = (load_file(d / "model.safetensors") for d in (tiny_dir, again, other))
    assert all(torch.equal(a[k].half(), b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert (again / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def test_init_refuses_what_it_cannot_do(tmp_path: Path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="is not empty: choose a new directory or pass --force"):
        init_model_dir("tiny", tmp_path / "full")
    with pytest.raises(UserError, match="random init is for tests and demos up to 2B"):
        init_model_dir("llama-3-8b", tmp_path / "big")
    with pytest.raises(NotFoundError, match="did you mean tiny"):
        init_model_dir("tinyy", tmp_path / "typo")
    with pytest.raises(ConfigError, match="use one of float32, bfloat16, float16"):
        init_model_dir("tiny", tmp_path / "dtype", dtype="int8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def test_bad_weights_are_named(tiny_dir: Path, tmp_path: Path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match="has neither model.safetensors nor"):
        load_model(bad)
    tensors = load_file(tiny_dir / "model.safetensors")
    tensors["extra.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="missing model.norm.weight, unexpected extra.weight"):
        load_model(bad)
    tensors["model.norm.weight"] = torch.ones(65)
    del tensors["extra.weight"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ConfigError, match=r"model.norm.weight has shape \[65\], config.json implies \[64\]"
    ):
        load_model(bad)
