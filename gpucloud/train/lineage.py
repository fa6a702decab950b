"""What produced a model, read from a `gpucloud train` run dir's own records: the resolved
config the workers read (base model, dataset, every setting) and the newest committed
checkpoint's `train.json` (its step; `gpucloud train export` exports that one by default).

An input given as a URL appears as its local copy in the storage cache: the config
records what the workers read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpucloud import storage
from gpucloud.errors import UserError
from gpucloud.models.content import tree_content


def run_lineage(run_dir: Path) -> dict[str, Any]:
    """{"base_model", "dataset", "dataset_hash", "train_config", "run", "step"} of a run.
    Raises UserError when `run_dir` is no run dir or holds no committed checkpoint."""
    from gpucloud.train import checkpoint, config
    from gpucloud.train.launcher import CONFIG_FILE

    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"{run_dir} is not a run dir of `gpucloud train run` (no {CONFIG_FILE})")
    cfg = config.load_resolved(path)
    newest = checkpoint.latest(cfg.checkpoint_dir(run_dir))
    if newest is None:
        raise UserError(f"{run_dir} holds no committed checkpoint: no step to record")
    step = json.loads(storage.read_bytes(storage.join(newest, "train.json")))["step"]
    return {
        "base_model": _absolute(cfg.model.path) if cfg.model.path else f"preset:{cfg.model.preset}",
        "dataset": cfg.data.path,
        "dataset_hash": tree_content(cfg.data.path).hash,
        "train_config": cfg.to_dict(),
        "run": str(run_dir.resolve()),
        "step": step,
    }


def _absolute(model_path: str) -> str:
    """A local model dir as the registry names it (absolute), so its registered version is
    found; a URL, or a path not found from here, as written."""
    if storage.is_url(model_path) or not Path(model_path).exists():
        return model_path
    return str(Path(model_path).resolve())
