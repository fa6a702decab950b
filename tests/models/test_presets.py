"""Every preset's counts against transformers' own model, built on the meta device."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from typer.testing import CliRunner

from gpucloud.cli.main import _app
from gpucloud.models import PRESETS, ModelSpec


def _hf_meta_model(spec: ModelSpec) -> torch.nn.Module:
    config = spec.to_hf_config()
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


@pytest.mark.parametrize("name", list(PRESETS))
def test_params_equal_transformers_and_model_info_prints_them(name: str):
    spec = PRESETS[name]
    hf = _hf_meta_model(spec)
    assert type(hf).__name__ == spec.architecture
    total = sum(p.numel() for p in hf.parameters())
    assert spec.num_params == total
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    per_expert = experts // (spec.num_hidden_layers * spec.num_local_experts)
    unused = spec.num_local_experts - spec.num_experts_per_tok
    assert spec.num_active_params == total - spec.num_hidden_layers * unused * per_expert

    result = CliRunner().invoke(_app, ["model", "info", name, "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert (info["params"], info["active_params"]) == (total, spec.num_active_params)
    assert info["weights_bytes"] == 2 * total  # presets default to bfloat16
    kv = 2 * hf.config.num_hidden_layers * hf.config.num_key_value_heads * spec.head_dim * 2
    assert info["kv_bytes_per_token"] == kv
