"""Fixtures of the serve tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpucloud.models.loader import init_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model_dir("tiny", tmp_path_factory.mktemp("serve") / "tiny", seed=0)


@pytest.fixture(scope="session")
def lora_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEFT adapters of the tiny model, by name (`lora_helpers.ADAPTERS`)."""
    from lora_helpers import ADAPTERS, make_peft_adapter

    root = tmp_path_factory.mktemp("lora")
    return {name: make_peft_adapter(tiny_model_dir, root / name, seed, **config)
            for seed, (name, config) in enumerate(ADAPTERS.items())}  # fmt: skip
