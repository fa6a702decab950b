"""Llama-family models. `spec` and `presets` are torch-free; `llama`, `loader` and
`tokenizer` need the ml extras and are imported only where tensors are needed."""

from gpucloud.models.presets import PRESETS, resolve_spec
from gpucloud.models.spec import ModelSpec

__all__ = ["PRESETS", "ModelSpec", "resolve_spec"]
