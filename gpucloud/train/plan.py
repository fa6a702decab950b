"""A run config in the planner's terms: its setup, and how long its steps take by the
planner's step time. Imports no torch: the control plane asks it how long a training job
will run (Slurm wants a time limit up front).
"""

from __future__ import annotations

from gpucloud import hardware
from gpucloud.hardware import Accelerator
from gpucloud.models.presets import resolve_spec
from gpucloud.planner import speed
from gpucloud.planner.setup import TrainSetup
from gpucloud.train import config


def planner_setup(
    cfg: config.RunConfig, world_size: int, gpu: Accelerator | None = None, nodes: int = 1
) -> TrainSetup:
    """The planner's terms for what the runtime runs on `world_size` processes over `nodes`
    nodes of `gpu` (H100-SXM when not given: the bytes do not depend on the accelerator):
    DDP is ZeRO-0; FSDP2 ZeRO-3, resharding after forward or not; mixed precision as the
    runtime does it (DDP under autocast, FSDP2 casting the parameters); tensor parallel
    with sequence-parallel norms."""
    p, lay = cfg.parallel, config.layout(cfg, world_size)
    return TrainSetup(
        gpu or hardware.get("H100-SXM"),
        gpus_per_node=world_size // nodes,
        nodes=nodes,
        zero=0 if p.strategy == "ddp" else 3,
        reshard_after_forward=p.reshard_after_forward,
        tp=lay.tp,
        sequence_parallel=lay.tp > 1,
        precision=cfg.precision.dtype,
        micro_batch=lay.micro_batch,
        seq_len=cfg.data.seq_len,
        recompute="full" if p.activation_checkpointing else "none",
        pp=lay.pp,
        ep=lay.ep,
        offload_optimizer=p.offload_optimizer,
        grad_accum=lay.accum,
        pipeline_schedule=p.pipeline_schedule,
    )


def steps_seconds(cfg: config.RunConfig, gpu_type: str, gpus_per_node: int, nodes: int) -> float:
    """The planner's time of the run's `optim.max_steps` steps on `nodes` nodes of
    `gpus_per_node` GPUs of `gpu_type`, one process per GPU: its step time (compute at the
    planner's MFU, communication) times the steps; no start-up, evaluation or checkpoints.
    Raises UserError (ConfigError) when the model or the layout cannot be resolved."""
    model = cfg.model.preset or cfg.model.path
    assert model is not None  # the config holds exactly one of them
    setup = planner_setup(cfg, gpus_per_node * nodes, hardware.get(gpu_type), nodes)
    return speed.train_speed(resolve_spec(model), setup).step_time_s * cfg.optim.max_steps
