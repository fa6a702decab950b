"""The planner's run time for a train job: the scheduler's estimate of a job that gives no
time limit (before its tenant's history, `cluster.load`). Computed once, at submission,
from the job's config; torch-free (the planner and the run config are pure Python)."""

from __future__ import annotations

from gpucloud import hardware
from gpucloud.errors import GpucloudError
from gpucloud.train import config
from gpucloud.train.planning import planned_run_seconds


def planned_seconds(
    train_config: str | None, model_dir: str | None, gpus: int, gpu_type: str | None
) -> float | None:
    """Steps x the planner's step time for a train job on `gpus` GPUs of `gpu_type`; None
    for a command job, or when the config, its model or its layout cannot be read here
    (the job still runs: the estimate falls back to its tenant's history)."""
    if train_config is None or gpu_type is None:
        return None
    try:
        cfg = config.load(train_config)
        return planned_run_seconds(cfg, gpus, hardware.get(gpu_type), model_dir)
    except (GpucloudError, OSError):
        return None
