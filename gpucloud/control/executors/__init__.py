"""Executors start, watch and stop workloads for the reconciler, each on its own engine
(the `Executor` protocol in executors.base): this machine, a Ray cluster, a Slurm cluster."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpucloud.errors import ConfigError

if TYPE_CHECKING:
    from gpucloud.control.config import Settings
    from gpucloud.control.executors.base import Executor

NAMES = ("local", "ray", "slurm")


def check_ray_address(address: str) -> None:
    """Raises ConfigError for a Ray Client address (ray://...): Ray Client needs the
    `ray[client]` extra (grpcio) on both ends, which gpucloud does not install, and a client
    cannot pin actors to nodes as the Ray executor does. The control plane is a Ray driver
    on a node of the cluster instead, given the GCS address."""
    if address.startswith("ray://"):
        raise ConfigError(
            f"--ray-address {address}: Ray Client addresses are not supported; run the control "
            "plane on a node of the Ray cluster (`ray start --address HOST:PORT`) and give the "
            "head's GCS address HOST:PORT, e.g. 10.0.0.1:6379"
        )


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
