"""Admission at submit time: could this request ever run here, within its tenant's quota?"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpucloud.control.db import memo
from gpucloud.control.lifecycle import NodeState
from gpucloud.control.models import Node, Quota
from gpucloud.errors import CapacityError
from gpucloud.scheduler import ClusterState
from gpucloud.scheduler import Job as SJob
from gpucloud.scheduler import Node as SNode


@dataclass(frozen=True, slots=True)
class Request:
    """What one workload (a job, or one replica of a deployment) asks for."""

    gpus: float  # below 1: a share of one GPU
    gpu_type: str | None = None
    cpu_milli: int = 0
    memory_mib: int = 0

    @classmethod
    def of(cls, gpus: float, gpu_type: str | None, cpus: float, memory_gib: float) -> Request:
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
    Admission(session).check(tenant_id, req)


class Admission:
    """`check_admissible` for many requests in one transaction: the pools, nodes and quotas
    are read once (when first needed), not once per request, for a batch of submissions."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._pools: dict[str, int] | None = None
        self._nodes: list[Node] | None = None
        self._quotas: dict[int, dict[str, int]] = {}

    def check(self, tenant_id: int, req: Request) -> None:
        """As `check_admissible`."""
        gpus, gpu_type = req.gpus, req.gpu_type
        pools = self.pools()
        if gpu_type is not None:
            pools = {t: n for t, n in pools.items() if t == gpu_type}
        fitting = [t for t, n in pools.items() if n >= gpus]
        if not fitting:
            have = ", ".join(f"{n} x {t}" for t, n in sorted(pools.items())) or "no such GPUs"
            raise CapacityError(
                f"{gpus} GPUs of {gpu_type or 'any type'} can never run here: the cluster has "
                f"{have}"
            )
        if req.cpu_milli or req.memory_mib:
            _check_hostable(req, [n for n in self.nodes() if n.gpu_type in fitting], fitting)
        caps = self.quotas(tenant_id)
        # A tenant with quotas may use only the types it has quota for; one without is
        # unlimited.
        if caps and all(caps.get(t, 0) < gpus for t in fitting):
            limits = ", ".join(f"{caps.get(t, 0)} x {t}" for t in fitting)
            raise CapacityError(f"{gpus} GPUs exceed your tenant's quota ({limits})")

    def pools(self) -> dict[str, int]:
        """GPUs per type on the nodes not down (the sum over a thousand nodes was a batch of
        submissions' costliest read: kept until a node changes, or a second)."""
        if self._pools is None:
            self._pools = memo(self.session, "pools", (Node,), None, self._read_pools)
        return self._pools

    def _read_pools(self) -> dict[str, int]:
        rows = self.session.connection().execute(
            select(Node.gpu_type, func.sum(Node.gpus))
            .where(Node.state != NodeState.DOWN)
            .group_by(Node.gpu_type)
        )
        return dict(rows.all())

    def nodes(self) -> list[Node]:
        if self._nodes is None:
            self._nodes = _nodes(self.session, None)
        return self._nodes

    def quotas(self, tenant_id: int) -> dict[str, int]:
        if tenant_id not in self._quotas:
            read = lambda: _quotas(self.session, tenant_id)  # noqa: E731
            self._quotas[tenant_id] = memo(self.session, "quotas", (Quota,), tenant_id, read)
        return self._quotas[tenant_id]


def check_replicas(session: Session, tenant_id: int, req: Request, replicas: int) -> None:
    """Raise CapacityError if `replicas` replicas, each asking for `req` on one node, could
    never run at once: not on the empty cluster (its nodes not down, of the types allowed),
    or not within the tenant's quotas. The message says how many could."""
    if replicas == 0:
        return
    nodes = _nodes(session, None if req.gpu_type is None else [req.gpu_type])
    held: dict[str, int] = {}  # GPU type -> replicas its nodes hold at once
    for n in nodes:
        held[n.gpu_type] = held.get(n.gpu_type, 0) + _replicas_on(n, req)
    most = sum(held.values())
    what = f"{replicas} replicas of {' and '.join(_asked(req))}"
    if replicas > most:
        have = ", ".join(_pool(req, t, [n for n in nodes if n.gpu_type == t]) for t in held)
        raise CapacityError(
            f"{what} can never run at once here: the cluster holds at most {most} ({have})"
        )
    caps = _quotas(session, tenant_id)
    if caps:
        within = sum(min(k, caps.get(t, 0) // req.gpus) for t, k in held.items())
        if replicas > within:
            limits = ", ".join(f"{caps.get(t, 0)} x {t}" for t in held)
            raise CapacityError(
                f"{what} exceed your tenant's quota ({limits}): it holds at most {within}"
            )


def _replicas_on(node: Node, req: Request) -> int:
    """How many replicas asking for `req` one node holds (0 CPUs or memory: not tracked)."""
    n = node.gpus // req.gpus
    if req.cpu_milli and node.cpu_milli:
        n = min(n, node.cpu_milli // req.cpu_milli)
    if req.memory_mib and node.memory_mib:
        n = min(n, node.memory_mib // req.memory_mib)
    return n


def _pool(req: Request, gpu_type: str, nodes: list[Node]) -> str:
    """'4 x L4', with the pool's CPUs and memory when the request asks for them."""
    host = []
    if req.cpu_milli:
        host.append(f"{cpus(sum(n.cpu_milli for n in nodes)):g} CPUs")
    if req.memory_mib:
        host.append(f"{gib(sum(n.memory_mib for n in nodes)):g} GiB of memory")
    gpus = sum(n.gpus for n in nodes)
    return f"{gpus} x {gpu_type}" + (f" with {' and '.join(host)}" if host else "")


def _asked(req: Request) -> list[str]:
    """'2 GPUs', '1.5 CPUs', '4 GiB of memory': what the request asks for."""
    asked = [f"{req.gpus} GPU{'s' if req.gpus != 1 else ''}"]
    asked += [f"{cpus(req.cpu_milli):g} CPUs"] if req.cpu_milli else []
    asked += [f"{gib(req.memory_mib):g} GiB of memory"] if req.memory_mib else []
    return asked


def _nodes(session: Session, types: list[str] | None) -> list[Node]:
    """The nodes not down, of `types` (None: any)."""
    q = select(Node).where(Node.state != NodeState.DOWN)
    if types is not None:
        q = q.where(Node.gpu_type.in_(types))
    return list(session.scalars(q))


def _quotas(session: Session, tenant_id: int) -> dict[str, int]:
    """The tenant's GPU quota per type; empty if it has none (unlimited)."""
    rows = select(Quota.gpu_type, Quota.gpus).where(Quota.tenant_id == tenant_id)
    return dict(session.connection().execute(rows).all())


def _check_hostable(req: Request, rows: list[Node], types: list[str]) -> None:
    """The scheduler core's rule on the empty cluster: some of these nodes (those of
    `types`, not down) could host the request's CPU and memory along with its GPUs."""
    state = ClusterState()
    for n in rows:
        state.add_node(
            SNode(n.name, n.gpu_type, n.gpus, cpu_milli=n.cpu_milli, memory_mib=n.memory_mib)
        )
    job = SJob("request", "-", math.ceil(req.gpus), gpu_types=tuple(types), cpu_milli=req.cpu_milli,
               memory_mib=req.memory_mib)  # fmt: skip
    if not state.hostable(job):
        largest = max(rows, key=lambda n: (n.cpu_milli, n.memory_mib))
        raise CapacityError(
            f"{' and '.join(_asked(req)[1:])} with {req.gpus} GPU(s) can never run here: the "
            f"largest node ({largest.name}) has {cpus(largest.cpu_milli):g} CPUs and "
            f"{gib(largest.memory_mib):g} GiB of memory"
        )
