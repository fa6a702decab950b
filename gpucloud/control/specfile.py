"""Reading a job or deployment spec file (YAML, or TOML by its suffix) into its schema."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from gpucloud.errors import ConfigError, GpucloudError

M = TypeVar("M", bound=BaseModel)


def load(path: str | Path, model: type[M]) -> M:
    """Parse and validate `path`. Raises ConfigError naming the file and each bad key."""
    p = Path(path)
    try:
        text = p.read_text()
        data = tomllib.loads(text) if p.suffix == ".toml" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read {p}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a mapping of keys (name, command, gpus, ...)")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc']) or 'spec'}: {err['msg']}" for err in e.errors()
        )
        raise ConfigError(f"{p}: {problems}") from None
    except GpucloudError as e:  # e.g. an unknown GPU type, with its "did you mean"
        raise ConfigError(f"{p}: {e}") from None
