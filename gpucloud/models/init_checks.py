"""Torch-free checks `gpucloud model init` runs before it imports torch, so a typo in the
output directory or preset costs a fraction of a second, not a torch import."""

from __future__ import annotations

from pathlib import Path

from gpucloud.errors import UserError
from gpucloud.models.spec import ModelSpec

# Random init is for tests and demos on one machine; past this a typo costs an OOM kill.
MAX_INIT_PARAMS = 2_000_000_000


def check_init(spec: ModelSpec, out: Path, force: bool) -> None:
    """Raise UserError unless `spec` can be initialized here into `out`."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"{out} is not empty: choose a new directory or pass --force")
    if spec.num_params > MAX_INIT_PARAMS:
        raise UserError(
            f"{spec.name} has {spec.num_params / 1e9:.1f}B parameters; random init is for "
            f"tests and demos up to {MAX_INIT_PARAMS / 1e9:.0f}B (e.g. the tiny and small presets)"
        )
