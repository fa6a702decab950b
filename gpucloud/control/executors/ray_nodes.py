"""The nodes of a Ray cluster as the Ray executor reports them.

A node of ours declares its accelerators as a custom resource `accel_<TYPE>` (TYPE a
hardware-catalog name: `ray start --resources '{"accel_A100": 8}'`); other nodes (the head,
CPU-only nodes) are not. A node labelled `gpucloud.io/node=NAME` keeps that name across
restarts, else it is `ray-<node id prefix>`. Its backend is the label `gpucloud.io/backend`,
else cuda when Ray sees GPUs there and cpu (virtual slots) when not.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

from gpucloud import hardware
from gpucloud.control.executors.base import NodeInfo
from gpucloud.errors import UserError

log = logging.getLogger(__name__)

ACCEL_PREFIX = "accel_"
NAME_LABEL = "gpucloud.io/node"
BACKEND_LABEL = "gpucloud.io/backend"


@dataclass(frozen=True, slots=True)
class RayNode:
    id: str
    name: str
    accel: str  # its accelerator resource, accel_<TYPE>
    alive: bool
    raylet: tuple[str, int] = ("", 0)  # its raylet's address and port


def answers(raylet: tuple[str, int], timeout: float) -> bool:
    """Whether the raylet at `raylet` accepts a connection within `timeout` seconds: a
    machine that died (or its raylet) does not, long before Ray's health checks say so."""
    try:
        socket.create_connection(raylet, timeout=timeout).close()
    except OSError:
        return False
    return True


def ray_node(raw: dict) -> tuple[RayNode, NodeInfo] | None:
    """A Ray node as ours, or None when it declares no accelerators (e.g. the head)."""
    resources = raw.get("Resources") or {}
    accels = sorted(k for k in resources if k.startswith(ACCEL_PREFIX))
    if not accels:
        return None
    labels = raw.get("Labels") or {}
    node_id = raw["NodeID"]
    name = labels.get(NAME_LABEL) or f"ray-{node_id[:12]}"
    try:
        gpu_type = hardware.get(accels[0].removeprefix(ACCEL_PREFIX)).name
    except UserError as e:
        log.warning("Ray node %s: %s", name, e)
        return None
    alive = bool(raw.get("Alive"))
    backend = labels.get(BACKEND_LABEL) or ("cuda" if resources.get("GPU") else "cpu")
    info = NodeInfo(
        name=name,
        gpu_type=gpu_type,
        gpus=int(resources[accels[0]]),
        backend=backend,
        address=raw.get("NodeManagerAddress") or "127.0.0.1",
        cpu_milli=int(resources.get("CPU", 0) * 1000),
        memory_mib=int(resources.get("memory", 0) / 2**20),
        labels={k: v for k, v in labels.items() if not k.startswith("ray.io/")},
        healthy=alive,
        reason=None if alive else death(raw),
    )
    raylet = (info.address, int(raw.get("NodeManagerPort") or 0))
    return RayNode(node_id, name, accels[0], alive, raylet), info


def death(raw: dict) -> str:
    message = raw.get("DeathReasonMessage") or raw.get("DeathReason")
    return f"Ray reports the node dead: {message}" if message else "Ray reports the node dead"
