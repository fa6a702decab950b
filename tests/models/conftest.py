from pathlib import Path

import pytest

from gpucloud.models.loader import init_model_dir


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One random-weight tiny model dir shared by the model tests (read-only for them)."""
    return init_model_dir("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)
