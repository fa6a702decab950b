"""config.json in either transformers dialect reads the same, and whatever we do not compute
is a one-line load error naming the key and what is supported — never a silent default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpucloud.errors import ConfigError
from gpucloud.models.loader import load_model
from gpucloud.models.spec import ModelSpec

BASE = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256}  # fmt: skip


def spec_of(**changes) -> ModelSpec:
    return ModelSpec.from_hf_config(BASE | changes, name="m")


@pytest.mark.parametrize(
    ("new", "legacy"),
    [
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, {"rope_theta": 5e5}),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
            {"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}},
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
            {"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 256}},
        ),
    ],
)  # fmt: skip
def test_both_dialects_give_one_spec(new, legacy):
    assert spec_of(**new) == spec_of(**legacy)
    assert spec_of(**new).rope_theta == (new["rope_parameters"]["rope_theta"])


def test_family_defaults_fill_absent_keys():
    assert spec_of(model_type="mixtral").rope_theta == 1e6  # MixtralConfig's default
    assert spec_of(model_type="qwen3").head_dim == 128  # Qwen3Config's, not hidden / heads
    assert spec_of(model_type="mistral").attention_window(0) == 4096
    qwen2 = spec_of(model_type="qwen2", sliding_window=8, max_window_layers=1)
    assert qwen2.attention_bias and qwen2.attention_window(1) is None  # use_sliding_window off
    qwen2 = spec_of(model_type="qwen2", sliding_window=8, max_window_layers=1,
                    use_sliding_window=True)  # fmt: skip
    assert [qwen2.attention_window(i) for i in (0, 1)] == [None, 8]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
         "'longrope' is not supported: use one of default, linear, dynamic, llama3, yarn"),
        ({"rope_scaling": {"type": "su", "factor": 2.0}}, "rope_type 'su' is not supported"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0,
                              "mrope_section": [1, 2]}},
         "RoPE parameter 'mrope_section' is not supported for rope_type 'linear': it takes factor"),
        ({"rope_scaling": {"type": "llama3", "factor": 8.0}},
         "rope_type 'llama3' needs high_freq_factor, low_freq_factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5 is not supported"),
        ({"rope_parameters": {"full_attention": {"rope_theta": 1e4},
                              "sliding_attention": {"rope_theta": 1e4}}},
         "per-layer-type rope_parameters"),
        ({"sliding_window": 4096}, "sliding_window = 4096 on llama is not supported"),
        ({"attn_logit_softcapping": 50.0},
         "key 'attn_logit_softcapping' (attention logit soft-capping) = 50.0 is not supported"),
        ({"final_logit_softcapping": 30.0}, "'final_logit_softcapping' (final logit soft-capping)"),
        ({"use_qk_norm": True}, "key 'use_qk_norm' (qk-norm) = True is not supported for llama"),
        ({"model_type": "mistral", "qk_layernorm": True}, "(qk-norm) = True is not supported"),
        ({"embedding_multiplier": 12.0}, "'embedding_multiplier' (an embedding multiplier)"),
        ({"mlp_bias": True}, "'mlp_bias' (MLP biases)"),
        ({"quantization_config": {"quant_method": "bitsandbytes", "bits": 4}},
         "quant_method 'bitsandbytes' is not supported: gptq or awq (4-bit)"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": 128}},
         "quantization_config.bits = 8 is not supported: gptq with 4 bits"),
        ({"quantization_config": {"quant_method": "awq", "bits": 3}}, "bits = 3 is not supported"),
        ({"quantization_config": {"quant_method": "awq", "bits": 4, "version": "gemv"}},
         "AWQ version 'gemv' with zero_point None is not supported"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4,
                                  "checkpoint_format": "marlin"}},
         "GPTQ checkpoint_format 'marlin' is not supported: gptq or gptq_v2"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported: silu only"),
        ({"model_type": "gemma"}, "model_type 'gemma' is not supported: use one of llama"),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
          "layer_types": ["full_attention", "chunked_attention"]},
         "layer_types must be 2 of full_attention / sliding_attention"),
    ],
)  # fmt: skip
def test_math_we_do_not_compute_is_a_one_line_load_error(changes, message):
    with pytest.raises(ConfigError) as e:
        spec_of(**changes)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_neutral_values_load(tmp_path: Path):
    spec = spec_of(mlp_bias=False, attn_logit_softcapping=None, embedding_multiplier=1.0,
                   rope_scaling={"rope_type": "default", "factor": 1.0})  # fmt: skip
    assert spec.rope_scaling is None


def test_load_model_reports_the_key(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(BASE | {"final_logit_softcapping": 30.0}))
    with pytest.raises(ConfigError, match="final_logit_softcapping"):
        load_model(tmp_path)
