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


def test_a_run_configs_steps_take_the_planners_step_time_each():
    """What the control plane gives Slurm as a training job's time: the planner's step time
    of the config's layout on the placement's GPUs, times its steps."""
    from gpucloud.planner.speed import train_speed
    from gpucloud.train import config
    from gpucloud.train.plan import planner_setup, steps_seconds

    run = {"model": {"preset": "llama-2-7b"}, "data": {"path": "data", "seq_len": 2048},
           "optim": {"global_batch": 64, "max_steps": 100}}  # fmt: skip
    cfg = config.parse(run)
    eight = steps_seconds(cfg, "H100-SXM", 8, 1)
    step = train_speed(LLAMA7, planner_setup(cfg, 8, H100)).step_time_s
    assert eight == pytest.approx(100 * step) and step > 1  # 8 × 64 × 2048 tokens a step
    longer = config.parse({**run, "optim": {"global_batch": 64, "max_steps": 200}})
    assert steps_seconds(longer, "H100-SXM", 8, 1) == pytest.approx(2 * eight)
    assert steps_seconds(cfg, "A100-80GB", 8, 1) > 2 * eight  # a third of the peak
    assert steps_seconds(cfg, "H100-SXM", 8, 2) < eight  # twice the GPUs


MIXTRAL = PRESETS["mixtral-8x7b"]


def moe(**kw):
    setup = TrainSetup(H100, **{"gpus_per_node": 8, "zero": 0, **kw})
    return estimate_training(MIXTRAL, setup).speed


def test_expert_parallel_syncs_the_experts_over_their_replicas_only():
    m = MIXTRAL
    experts = m.num_hidden_layers * m.num_local_experts * m.expert_params
    shared = m.num_params - experts
    ep1, ep8 = moe(), moe(ep=8)
    # ep=1: every parameter all-reduced over the 8 ranks; ep=8: each rank holds its own
    # experts whole, so only the shared parameters are all-reduced.
    assert ep1.comm_bytes_per_gpu == pytest.approx(2 * 7 / 8 * m.num_params * 2)
    assert ep8.comm_bytes_per_gpu == pytest.approx(2 * 7 / 8 * shared * 2)
    assert ep8.comm_s < ep1.comm_s / 5
    # 2 nodes, ep=8: each expert has a replica on the other node, all-reduced after backward
    # (as the runtime does) over that node's NICs, which the 8 expert rings share.
    two = moe(nodes=2, ep=8)
    expert_volume = 2 * 1 / 2 * experts / 8 * 2
    assert two.comm_bytes_per_gpu == pytest.approx(2 * 15 / 16 * shared * 2 + expert_volume)
    ring = min(H100.link_bandwidth / 2, H100.node_network_bandwidth)  # one ring per server
    shared_s = 2 * 15 / 16 * shared * 2 / ring + 32 * 15 * 10e-6
    expert_s = expert_volume / (H100.node_network_bandwidth / 8) + 10e-6
    assert two.comm_s == pytest.approx(shared_s + expert_s)
    assert two.exposed_comm_s >= expert_s  # after backward: nothing hides it


def test_expert_all_to_alls_follow_the_tokens_and_the_hand_computed_volume():
    ep1, ep8, ep8_twice = moe(), moe(ep=8), moe(ep=8, micro_batch=2)
    assert ep1.all_to_all_s == 0 and ep1.all_to_all_bytes_per_gpu == 0
    # Per MoE layer and micro-batch: dispatch + combine, forward and backward; each sends
    # tokens × top-k × hidden × 4 bytes (DDP's autocast keeps the residual stream fp32), the
    # 1/8 for its own experts staying on the GPU.
    tokens = 2048
    per_call = 7 / 8 * tokens * 2 * 4096 * 4
    assert ep8.all_to_all_bytes_per_gpu == pytest.approx(4 * 32 * per_call)
    transfer = 4 * 32 * per_call / (H100.link_bandwidth / 2)
    assert ep8.all_to_all_s == pytest.approx(transfer + 4 * 32 * 10e-6)  # a latency per call
    assert ep8_twice.all_to_all_s == pytest.approx(ep8.all_to_all_s + transfer)
    assert ep8.exposed_comm_s >= ep8.all_to_all_s  # between router and experts: exposed
    full = moe(ep=8, recompute="full")  # the forward's two again in backward
    assert full.all_to_all_bytes_per_gpu == pytest.approx(6 * 32 * per_call)
    # FSDP2 computes in bf16: 2 bytes a value.
    assert moe(ep=8, zero=3).all_to_all_bytes_per_gpu == pytest.approx(4 * 32 * per_call / 2)


def test_an_expert_group_spanning_nodes_exchanges_tokens_over_the_network():
    inside, spanning = moe(ep=8), moe(gpus_per_node=4, nodes=2, ep=8)
    assert spanning.all_to_all_bytes_per_gpu == pytest.approx(inside.all_to_all_bytes_per_gpu)
    assert spanning.all_to_all_s > 2 * inside.all_to_all_s
    # Half of what a GPU sends leaves the server, over its share of the server's NICs.
    half = 4 / 8 * 2048 * 2 * 4096 * 4
    per_call = half / (H100.node_network_bandwidth / 4) + 10e-6
    assert spanning.all_to_all_s == pytest.approx(4 * 32 * per_call)
    assert spanning.step_time_s > inside.step_time_s
    # 6 GPUs a server, ep = 4: the second group has 2 ranks on each server, and its ranks
    # send half of their tokens over the network while the others stay inside theirs.
    straddling = moe(gpus_per_node=6, nodes=2, ep=4)
    per_call = 2 / 4 * 2048 * 2 * 4096 * 4 / (H100.node_network_bandwidth / 6) + 10e-6
    assert straddling.all_to_all_s == pytest.approx(4 * 32 * per_call)


def ddp_sync_s(setup: TrainSetup, spec=LLAMA7) -> float:
    return estimate_training(spec, setup).speed.comm_s


def test_data_parallel_rings_share_the_nics_of_the_servers_they_leave():
    """tp = 8 on 8-GPU servers: each GPU of a server is in a different data-parallel group
    (one rank per server), and the 8 rings all sync at once over the server's NICs."""
    setup = TrainSetup(H100, gpus_per_node=8, nodes=4, tp=8)
    volume = 2 * 3 / 4 * LLAMA7.num_params / 8 * 2  # DDP all-reduce of a TP shard, dp = 4
    per_ring = H100.node_network_bandwidth / 8  # 50 GB/s, not the 400 of all the NICs
    assert estimate_training(LLAMA7, setup).speed.comm_bytes_per_gpu == pytest.approx(volume)
    assert ddp_sync_s(setup) == pytest.approx(volume / per_ring + 32 * 3 * 10e-6)
    # tp = 2, pp = 2 over 4 servers: a stage fills two servers, so each server sends the two
    # rings of its stage (one per tp rank), 8 ranks each, over its NICs.
    setup = TrainSetup(H100, gpus_per_node=8, nodes=4, tp=2, pp=2)
    volume = 2 * 7 / 8 * LLAMA7.num_params / 4 * 2
    per_ring = min(H100.link_bandwidth / 2, H100.node_network_bandwidth / 2)
    assert ddp_sync_s(setup) == pytest.approx(volume / per_ring + 16 * 7 * 10e-6)


def test_data_parallel_rings_inside_one_server_stay_off_the_network():
    """tp = 2, pp = 2 on 2 servers: the runtime's (pp, dp, tp) mesh puts stage 0 on the
    first server and stage 1 on the second, so each data-parallel ring is 4 GPUs of one
    server on NVLink."""
    setup = TrainSetup(H100, gpus_per_node=8, nodes=2, tp=2, pp=2)
    volume = 2 * 3 / 4 * LLAMA7.num_params / 4 * 2
    assert ddp_sync_s(setup) == pytest.approx(volume / (H100.link_bandwidth / 2) + 16 * 3 * 10e-6)
    # On RTX-4090 servers (PCIe only, two 25 GbE ports) the same stays on PCIe, far faster
    # than the network.
    rtx = hardware.get("RTX-4090")
    inside = TrainSetup(rtx, gpus_per_node=8, nodes=2, tp=2, pp=2)
    assert ddp_sync_s(inside) == pytest.approx(volume / (64e9 / 2) + 16 * 3 * 10e-6)


def test_the_ring_sharing_the_busiest_server_sets_the_pace():
    """pp = 2 over 3 servers of 8: a stage is 12 ranks, 8 on one server and 4 on the next,
    so the middle server sends both stages' rings and each gets half of its NICs."""
    setup = TrainSetup(H100, gpus_per_node=8, nodes=3, pp=2)
    volume = 2 * 11 / 12 * LLAMA7.num_params / 2 * 2
    per_ring = H100.node_network_bandwidth / 2
    assert ddp_sync_s(setup) == pytest.approx(volume / per_ring + 16 * 11 * 10e-6)


def test_expert_groups_follow_the_stages_onto_their_servers():
    """pp = 2, ep = 8 on 2 servers of 8: each stage's 8 data-parallel ranks are one server,
    so the expert all-to-alls stay on NVLink, over half the layers each."""
    inside = moe(ep=8)
    piped = moe(nodes=2, pp=2, ep=8, grad_accum=1)
    assert piped.all_to_all_s == pytest.approx(inside.all_to_all_s / 2)
