"""Recommendations: every listed option fits with the headroom, cheapest first, and the
rest say why not."""

import pytest

from gpucloud import hardware
from gpucloud.errors import UserError
from gpucloud.models.presets import PRESETS
from gpucloud.planner import (
    ServeSetup,
    TrainSetup,
    estimate_inference,
    estimate_training,
    recommend,
)

LLAMA70 = PRESETS["llama-3-70b"]


def test_serving_options_fit_with_headroom_cheapest_first():
    rec = recommend(LLAMA70, "serve", concurrency=64, max_seq_len=4096)
    assert rec.options
    hourly = [o.usd_per_hour for o in rec.options]
    assert hourly == sorted(hourly)
    for o in rec.options:
        assert o.per_gpu_bytes <= 0.9 * o.gpu_memory_bytes
        gpu = hardware.get(o.gpu)
        setup = ServeSetup(gpu, max_seq_len=4096, concurrency=64, memory_fraction=0.9,
                           quant=o.settings["quant"], tp=o.settings["tp"])  # fmt: skip
        assert estimate_inference(LLAMA70, setup).fits
        if o.gpus > 1:  # the smallest tensor-parallel degree that fits
            smaller = ServeSetup(gpu, max_seq_len=4096, concurrency=64, memory_fraction=0.9,
                                 quant=o.settings["quant"], tp=o.gpus // 2)  # fmt: skip
            assert not estimate_inference(LLAMA70, smaller).fits
    reasons = {(o.gpu, o.strategy): o.reason for o in rec.rejected}
    assert reasons[("A100-80GB", "fp8")] == "no fp8 tensor cores"
    a10 = [r for (gpu, _), r in reasons.items() if gpu == "A10"]
    assert a10 and all("limit 21.6 GiB" in r or "fp8" in r for r in a10)


def test_training_options_are_the_cheapest_fitting_configuration_per_gpu():
    rec = recommend(PRESETS["llama-2-7b"], "train", tokens=1e10, seq_len=4096)
    costs = [o.usd for o in rec.options]
    assert costs == sorted(costs)
    h100 = next(o for o in rec.options if o.gpu == "H100-SXM")
    s = h100.settings
    setup = TrainSetup(hardware.get("H100-SXM"), gpus_per_node=s["gpus"], nodes=s["nodes"],
                       zero=s["zero"], recompute=s["recompute"], seq_len=4096,
                       offload_optimizer=s["offload_optimizer"])  # fmt: skip
    plan = estimate_training(PRESETS["llama-2-7b"], setup, tokens=1e10)
    assert plan.memory.fits_with_headroom(0.10)
    assert plan.cost.usd == pytest.approx(h100.usd)
    # Half as many GPUs with the same strategy would not fit (or it would have been listed).
    if h100.gpus > 1:
        half = TrainSetup(hardware.get("H100-SXM"), gpus_per_node=min(8, h100.gpus // 2),
                          nodes=max(1, h100.gpus // 16), zero=s["zero"],
                          recompute=s["recompute"], seq_len=4096)  # fmt: skip
        assert not estimate_training(PRESETS["llama-2-7b"], half).memory.fits_with_headroom(0.1)


def test_models_too_big_for_a_gpu_type_are_rejected_with_the_reason():
    rec = recommend(PRESETS["llama-3.1-405b"], "train", max_gpus=8)
    assert not rec.options
    assert len(rec.rejected) == len(hardware.all_accelerators())
    assert all("does not fit on up to 8 GPUs" in o.reason for o in rec.rejected)


def test_bad_recommend_input():
    with pytest.raises(UserError, match="--task must be one of train, serve"):
        recommend(LLAMA70, "finetune")
    with pytest.raises(UserError, match="--headroom must be in"):
        recommend(LLAMA70, "serve", headroom=1.5)


def test_pcie_consumer_cards_rank_below_nvlink_datacenter_gpus_for_70b():
    """Once the step pays for the gradient sync, a cluster of GeForce cards on Ethernet
    is no longer among the cheapest ways to train a 70B model."""
    rec = recommend(PRESETS["llama-2-70b"], "train")
    rank = {o.gpu: i for i, o in enumerate(rec.options)}
    for consumer in ("RTX-4090",):
        for datacenter in ("H100-SXM", "A100-40GB", "B200"):
            assert rank[consumer] > rank[datacenter], (consumer, datacenter)
    assert rank["RTX-4090"] >= 5  # not among the best five
