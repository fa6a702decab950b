"""Admission at submit time: could this request ever run here, within its tenant's quota?"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpucloud.control.lifecycle import NodeState
from gpucloud.control.models import Node, Quota
from gpucloud.errors import CapacityError
from gpucloud.scheduler import ClusterState
from gpucloud.scheduler import Job as SJob
from gpucloud.scheduler import Node as SNode


@dataclass(frozen=True, slots=True)
class Request:
    """What one workload (a job, or one replica of a deployment) asks for."""

    gpus: int
    gpu_type: str | None = None
    cpu_milli: int = 0
    memory_mib: int = 0

    @classmethod
    def of(cls, gpus: int, gpu_type: str | None, cpus: float, memory_gib: float) -> Request:
        """From the API's units, rounded up: 0.1 cores is 100 millicores, 1.5 GiB 1,536 MiB."""
        return cls(gpus, gpu_type, _up(cpus * 1000), _up(memory_gib * 1024))


def _up(x: float) -> int:
    return math.ceil(round(x, 6))  # 0.1 * 1000 is 100.00000000000001, still 100


def cpus(milli: int) -> float:
    return milli / 1000


def gib(mib: int) -> float:
    return round(mib / 1024, 3)


def check_admissible(session: Session, tenant_id: int, req: Request) -> None:
    """Raise CapacityError if no pool (nodes not down, of `gpu_type` or any type) holds
    `gpus` GPUs, if no node of such a pool has the CPU and memory it asks for, or if the
    tenant has quotas and each such type's is smaller than `gpus`."""
    gpus, gpu_type = req.gpus, req.gpu_type
    pools = dict(
        session.execute(
            select(Node.gpu_type, func.sum(Node.gpus))
            .where(Node.state != NodeState.DOWN)
            .group_by(Node.gpu_type)
        ).all()
    )
    if gpu_type is not None:
        pools = {t: n for t, n in pools.items() if t == gpu_type}
    fitting = [t for t, n in pools.items() if n >= gpus]
    if not fitting:
        have = ", ".join(f"{n} x {t}" for t, n in sorted(pools.items())) or "no such GPUs"
        raise CapacityError(
            f"{gpus} GPUs of {gpu_type or 'any type'} can never run here: the cluster has {have}"
        )
    _check_hostable(session, req, fitting)
    caps = dict(
        session.execute(
            select(Quota.gpu_type, Quota.gpus).where(Quota.tenant_id == tenant_id)
        ).all()
    )
    # A tenant with quotas may use only the types it has quota for; one without is unlimited.
    if caps and all(caps.get(t, 0) < gpus for t in fitting):
        limits = ", ".join(f"{caps.get(t, 0)} x {t}" for t in fitting)
        raise CapacityError(f"{gpus} GPUs exceed your tenant's quota ({limits})")


def _check_hostable(session: Session, req: Request, types: list[str]) -> None:
    """The scheduler core's rule on the empty cluster: some nodes of these types could host
    the request's CPU and memory along with its GPUs."""
    if not (req.cpu_milli or req.memory_mib):
        return
    rows = session.scalars(
        select(Node).where(Node.state != NodeState.DOWN, Node.gpu_type.in_(types))
    ).all()
    state = ClusterState()
    for n in rows:
        state.add_node(
            SNode(n.name, n.gpu_type, n.gpus, cpu_milli=n.cpu_milli, memory_mib=n.memory_mib)
        )
    job = SJob("request", "-", req.gpus, gpu_types=tuple(types), cpu_milli=req.cpu_milli,
               memory_mib=req.memory_mib)  # fmt: skip
    if not state.hostable(job):
        asked = [f"{cpus(req.cpu_milli):g} CPUs"] if req.cpu_milli else []
        asked += [f"{gib(req.memory_mib):g} GiB of memory"] if req.memory_mib else []
        largest = max(rows, key=lambda n: (n.cpu_milli, n.memory_mib))
        raise CapacityError(
            f"{' and '.join(asked)} with {req.gpus} GPU(s) can never run here: the largest "
            f"node ({largest.name}) has {cpus(largest.cpu_milli):g} CPUs and "
            f"{gib(largest.memory_mib):g} GiB of memory"
        )
