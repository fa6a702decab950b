"""Executors start, watch and stop workloads for the reconciler, each on its own engine
(the `Executor` protocol in executors.base): this machine, a Ray cluster, a Slurm cluster."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpucloud.errors import ConfigError

if TYPE_CHECKING:
    from gpucloud.control.config import Settings
    from gpucloud.control.executors.base import Executor

NAMES = ("local", "ray", "slurm")


def create(settings: Settings) -> Executor:
    """The executor `settings.executor` names; an engine's client library is imported only
    when it is the one chosen."""
    if settings.executor == "local":
        from gpucloud.control.executors.local import LocalExecutor

        return LocalExecutor(settings)
    if settings.executor == "ray":
        from gpucloud.control.executors.ray import RayExecutor

        return RayExecutor(settings)
    if settings.executor == "slurm":
        from gpucloud.control.executors.slurm import SlurmExecutor

        return SlurmExecutor(settings)
    raise ConfigError(f"unknown executor {settings.executor!r}: use one of {', '.join(NAMES)}")
