"""Mixture-of-experts training: routing's balance loss (equal to transformers' Mixtral
aux_loss on the same weights) and capacity, a short run that logs both and keeps the
export's logits equal to transformers' (tests/train/test_export_roundtrip.py checks the
round trip of a trained Mixtral), the config checks, and FLOPs from the active parameters."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hf_families import ROWS, build
from train_helpers import run_config

from gpucloud.errors import ConfigError
from gpucloud.models.loader import load_model
from gpucloud.models.moe import balance_loss, within_capacity
from gpucloud.models.presets import PRESETS
from gpucloud.train import config, launcher
from gpucloud.train.moe import MoeTraining

MIXTRAL = next(r for r in ROWS if r.name == "mixtral-moe")  # 4 experts, 2 per token


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixtral")
    build(MIXTRAL, out, vocab=2048)  # the dataset's tokenizer has 2048 tokens
    return out


def test_the_balance_loss_is_k_when_even_and_grows_as_routing_collapses():
    even = torch.full((8, 4), 0.25)
    spread = torch.tensor([[0, 1], [2, 3]] * 4)
    assert balance_loss(even, spread).item() == pytest.approx(2.0)
    collapsed = torch.tensor([[0.7, 0.3, 0.0, 0.0]] * 8)
    assert balance_loss(collapsed, torch.tensor([[0, 1]] * 8)).item() == pytest.approx(4.0)


def test_capacity_serves_first_choices_before_second_choices():
    # 4 tokens × 2 choices over 4 experts: an even share is 2 assignments per expert.
    chosen = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 0]])
    kept = within_capacity(chosen, experts=4, factor=1.0)
    # Expert 0: the first choices of tokens 0 and 1 fit; token 2's first choice and token 3's
    # second do not (first choices queue before any second choice).
    assert kept.tolist() == [[True, True], [True, True], [False, True], [True, False]]
    assert within_capacity(chosen, experts=4, factor=2.0).all()


def test_the_balance_loss_is_transformers_mixtral_aux_loss(mixtral_dir):
    import transformers

    ours = load_model(mixtral_dir).train()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(mixtral_dir).train()
    ids = torch.randint(3, 2048, (2, 24), generator=torch.Generator().manual_seed(0))
    ours(ids)
    expected = theirs(ids, output_router_logits=True).aux_loss
    torch.testing.assert_close(MoeTraining(None, ours).aux_loss(), expected.float())


def test_an_moe_run_logs_its_balance_loss_and_the_tokens_it_dropped(mixtral_dir, dataset,
                                                                    train_here):  # fmt: skip
    cfg = run_config(dataset, "optim.max_steps=4", "moe.capacity_factor=0.5")
    cfg["model"] = {"path": str(mixtral_dir)}
    outcome, records, _ = train_here(cfg)
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 4 and all(math.isfinite(r["loss"]) for r in steps)
    # Between k (even) and k × experts (collapsed); capacity at half the even share drops
    # at least half of the assignments.
    assert all(2 * 0.9 < r["aux_loss"] < 8 for r in steps)
    assert all(0.5 <= r["dropped_tokens"] < 1 for r in steps)


def test_moe_settings_are_checked_before_a_run_starts(mixtral_dir, dataset):
    dense = config.parse(run_config(dataset, "moe.capacity_factor=1.25"))
    with pytest.raises(ConfigError, match=r"\[moe\] applies to mixture-of-experts models; tiny"):
        launcher.preflight(dense, 1)
    piped = run_config(dataset, "parallel.pipeline_stages=2")
    piped["model"] = {"path": str(mixtral_dir)}
    with pytest.raises(ConfigError, match="mixture-of-experts models train with"):
        launcher.preflight(config.parse(piped), 2)


def test_training_flops_count_only_the_active_experts():
    """The trainer's MFU uses spec.flops_per_token: 8 experts with 2 per token cost as much
    as one dense MLP twice as wide, plus the router."""
    mixtral = PRESETS["mixtral-8x7b"]
    dense = replace(mixtral, model_type="mistral", num_local_experts=1, num_experts_per_tok=1,
                    intermediate_size=2 * mixtral.intermediate_size)  # fmt: skip
    router = mixtral.num_hidden_layers * mixtral.router_params_per_layer
    assert mixtral.flops_per_token(4096) == dense.flops_per_token(4096) + 6 * router
