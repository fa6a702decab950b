"""The OpenAI-compatible HTTP server around `LLMEngine`: `build_app` and `run`."""

from gpucloud.serve.api.app import build_app
from gpucloud.serve.api.server import run
from gpucloud.serve.api.state import APISettings

__all__ = ["APISettings", "build_app", "run"]
