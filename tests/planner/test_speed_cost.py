"""Training speed from FLOPs at a stated MFU, and GPU-hours × price."""

import pytest

from gpucloud import hardware
from gpucloud.errors import UserError
from gpucloud.models.presets import PRESETS
from gpucloud.planner import TrainSetup, estimate_training

H100 = hardware.get("H100-SXM")
LLAMA7 = PRESETS["llama-2-7b"]


def plan(**kw):
    setup = TrainSetup(H100, **{"gpus_per_node": 8, "zero": 3, **kw})
    return estimate_training(LLAMA7, setup, tokens=1e9)


def test_step_time_is_flops_over_peak_times_mfu():
    p = plan(micro_batch=2, seq_len=4096, mfu=0.5)
    flops = LLAMA7.flops_per_token(4096)
    assert flops > 6 * LLAMA7.num_params  # attention adds to 6·N
    tokens = 2 * 4096 * 8
    assert p.speed.step_time_s == pytest.approx(tokens * flops / (8 * H100.bf16_flops * 0.5))
    assert p.speed.tokens_per_s == pytest.approx(tokens / p.speed.step_time_s)
    assert p.speed.mfu == pytest.approx(0.5)


def test_full_recompute_costs_a_third_more_and_fp32_runs_at_tf32_rate():
    base, full = plan(), plan(recompute="full")
    assert full.speed.step_time_s == pytest.approx(base.speed.step_time_s * 4 / 3)
    assert full.speed.mfu == pytest.approx(0.4 * 3 / 4)
    assert plan(precision="fp32").speed.step_time_s == pytest.approx(2 * base.speed.step_time_s)


def test_more_gpus_train_faster_at_the_same_cost():
    eight, sixteen = plan(), plan(nodes=2)
    assert sixteen.speed.tokens_per_s == pytest.approx(2 * eight.speed.tokens_per_s)
    assert sixteen.cost.usd == pytest.approx(eight.cost.usd)
    c = eight.cost
    assert c.time_s == pytest.approx(1e9 / eight.speed.tokens_per_s)
    assert c.usd == pytest.approx(c.time_s / 3600 * 8 * H100.price_per_hour)


def test_offloaded_optimizer_adds_host_time():
    assert plan(offload_optimizer=True).speed.step_time_s > plan().speed.step_time_s


def test_moe_flops_count_only_active_experts():
    mixtral = PRESETS["mixtral-8x7b"]
    assert mixtral.flops_per_token(1) < 6 * mixtral.num_params / 3


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"zero": 4}, "--zero must be 0, 1, 2 or 3"),
        ({"precision": "int8"}, "--precision must be one of fp32, bf16, fp16, pure-bf16"),
        ({"recompute": "some"}, "--recompute must be one of none, selective, full"),
        ({"gpus_per_node": 8, "tp": 3}, "--tp 3 must divide --gpus 8"),
        ({"gpus_per_node": 8, "tp": 2, "pp": 3}, r"--tp × --pp \(2 × 3\) must divide the 8"),
        ({"sequence_parallel": True}, "--sequence-parallel needs --tp 2"),
        ({"zero": 0, "offload_optimizer": True}, "--offload-optimizer needs --zero 1, 2 or 3"),
        ({"micro_batch": 0}, "--micro-batch must be a positive integer"),
        ({"mfu": 1.5}, r"--mfu must be in \(0, 1\]"),
    ],
)
def test_bad_training_setups_name_what_is_allowed(kw, message):
    with pytest.raises(UserError, match=message):
        TrainSetup(H100, **kw)


def test_token_budget_must_be_positive():
    with pytest.raises(UserError, match="--tokens must be a positive token budget"):
        estimate_training(LLAMA7, TrainSetup(H100), tokens=0)


def test_splits_the_model_cannot_take_are_user_errors():
    with pytest.raises(UserError, match="--pp 64 exceeds the 32 layers"):
        estimate_training(LLAMA7, TrainSetup(H100, gpus_per_node=8, nodes=8, pp=64))
    qwen = PRESETS["qwen2.5-7b"]  # 28 heads, 4 KV heads: tp=7 splits heads, not KV heads
    with pytest.raises(UserError, match="--tp 7 must divide, or be a multiple of, the 4 KV"):
        estimate_training(qwen, TrainSetup(H100, gpus_per_node=7, tp=7))


def test_the_pipeline_bubble_stretches_the_step():
    # (pp - 1) / (m + pp - 1) of the step idles: 3/11 with 4 stages and 8 micro-batches.
    one, piped = plan(zero=0, grad_accum=8), plan(zero=0, pp=4, grad_accum=8)
    assert piped.speed.bubble_fraction == pytest.approx(3 / 11)
    assert piped.speed.compute_s == pytest.approx(one.speed.compute_s / 4 * 11 / 8)
    assert "a bubble of 27% of the step" in " ".join(piped.notes)


def test_gradient_sync_volume_follows_the_ring_collectives():
    n, phi = 8, LLAMA7.num_params
    ddp, zero3 = plan(zero=0).speed, plan(zero=3).speed
    assert ddp.comm_bytes_per_gpu == pytest.approx(2 * (n - 1) / n * phi * 2)  # all-reduce
    # ZeRO-3: gather for forward, gather again for backward, reduce-scatter the gradients.
    assert zero3.comm_bytes_per_gpu == pytest.approx(3 * (n - 1) / n * phi * 2)
    assert zero3.comm_s > ddp.comm_s


def test_communication_a_slow_network_cannot_hide_lengthens_the_step():
    # 7B over 2 servers: NVLink + 8 x 400 Gb/s hides the sync behind compute; two 25 GbE
    # ports per server of GeForce cards do not.
    fast = plan(nodes=2).speed
    assert fast.exposed_comm_s == 0 and fast.step_time_s == pytest.approx(fast.compute_s)
    setup = TrainSetup(hardware.get("RTX-4090"), gpus_per_node=8, nodes=2, zero=3)
    slow = estimate_training(LLAMA7, setup).speed
    assert slow.comm_s > slow.compute_s
    assert slow.step_time_s == pytest.approx(slow.compute_s + slow.exposed_comm_s)
    assert slow.exposed_comm_s > 0.5 * slow.compute_s
