"""A run config in the planner's terms, without torch: what the control plane needs to
predict a train job's step time (and what the planner-vs-runtime checks compare)."""

from __future__ import annotations

from gpucloud import hardware
from gpucloud.hardware import Accelerator
from gpucloud.models.presets import resolve_spec
from gpucloud.planner import speed
from gpucloud.planner.setup import TrainSetup
from gpucloud.train import config


def planner_setup(
    cfg: config.RunConfig, world_size: int, gpu: Accelerator | None = None
) -> TrainSetup:
    """The planner's terms for what the runtime runs: DDP is ZeRO-0; FSDP2 ZeRO-3, or ZeRO-2
    when it keeps the gathered parameters from forward to backward; mixed precision as the
    runtime does it (DDP under autocast, FSDP2 casting the parameters). `gpu`: the
    accelerator it runs on (memory plans do not depend on it: H100-SXM by default)."""
    p, lay = cfg.parallel, config.layout(cfg, world_size)
    zero = 0 if p.strategy == "ddp" else (3 if p.reshard_after_forward else 2)
    return TrainSetup(
        gpu or hardware.get("H100-SXM"),
        gpus_per_node=world_size,
        zero=zero,
        precision=cfg.precision.dtype,
        micro_batch=lay.micro_batch,
        seq_len=cfg.data.seq_len,
        recompute="full" if p.activation_checkpointing else "none",
        pp=lay.pp,
        offload_optimizer=p.offload_optimizer,
        grad_accum=lay.accum,
        pipeline_schedule=p.pipeline_schedule,
    )


def planned_run_seconds(
    cfg: config.RunConfig, world_size: int, gpu: Accelerator, model_dir: str | None = None
) -> float:
    """Seconds the run should take: its steps x the planner's step time on `world_size`
    GPUs of `gpu` (start-up, evaluation and checkpoints not counted). `model_dir`: the
    model the run starts from when the config names none (a registered model). Raises
    ConfigError or UserError when the model or the layout cannot be read."""
    spec = resolve_spec(cfg.model.preset or cfg.model.path or model_dir or "")
    setup = planner_setup(cfg, world_size, gpu)
    return cfg.optim.max_steps * speed.train_speed(spec, setup).step_time_s
