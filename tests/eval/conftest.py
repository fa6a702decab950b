"""Fixtures of the evaluation tests: a tiny random model directory, made once."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpucloud.models.loader import init_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model_dir("tiny", tmp_path_factory.mktemp("eval") / "tiny", seed=0)
