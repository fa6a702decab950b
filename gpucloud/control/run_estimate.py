"""The planner's run time for a train job: the scheduler's estimate of a job that gives no
time limit (before its tenant's history, `cluster.load`), computed at submission, and
Slurm's --time, computed at launch on the placement. Torch-free (the planner and the run
config are pure Python)."""

from __future__ import annotations

import json
import logging

from gpucloud.errors import GpucloudError
from gpucloud.train import config, plan

log = logging.getLogger(__name__)


def planned_seconds(
    train_config: str | None,
    model_dir: str | None,
    gpu_type: str | None,
    gpus_per_node: int,
    nodes: int = 1,
) -> float | None:
    """Steps x the planner's step time for a train job on `nodes` nodes of `gpus_per_node`
    GPUs of `gpu_type`; `model_dir`: the registered model it starts from, if any. None for
    a command job, or when the config, its model or its layout cannot be read here (e.g. a
    model on object storage): the job still runs, estimated by its tenant's history."""
    if train_config is None or gpu_type is None:
        return None
    overrides = [f"model.path={json.dumps(model_dir)}"] if model_dir else []
    try:
        cfg = config.load(train_config, overrides)
        return plan.steps_seconds(cfg, gpu_type, gpus_per_node, nodes)
    except (GpucloudError, OSError, ValueError) as e:
        log.info("no planner estimate for %s: %s", train_config, e)
        return None
