"""Nodes: the machines whose accelerators the control plane hands out."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud import hardware
from gpucloud.control.auth import Principal
from gpucloud.control.lifecycle import REPLICA_HOLDS_GPUS, JobState, NodeState
from gpucloud.control.models import Deployment, Job, Node, Replica
from gpucloud.control.schemas import NodePublic
from gpucloud.control.services import audit, capacity
from gpucloud.errors import ConfigError, NotFoundError


def names(session: Session) -> dict[int, str]:
    """Node id → name, for the public views of jobs and deployments."""
    return dict(session.execute(select(Node.id, Node.name)).all())


def register(
    session: Session,
    name: str,
    gpu_type: str,
    gpus: int,
    backend: str,
    labels: dict[str, str] | None = None,
    cpu_milli: int = 0,
    memory_mib: int = 0,
) -> Node:
    """Add the node, or refresh it (type, counts, heartbeat) when it is already known.
    `cpu_milli` and `memory_mib` are what it offers to workloads (0 = not tracked).

    A cordoned node stays cordoned; a node that was down is ready again.
    """
    acc = hardware.get(gpu_type)
    if gpus < 1:
        raise ConfigError(f"node {name} must have at least 1 GPU, got {gpus}")
    domain = min(acc.link_domain, gpus)
    while gpus % domain:  # the catalog's domain may not divide an odd-sized machine
        domain -= 1
    now = time.time()
    node = session.scalar(select(Node).where(Node.name == name))
    if node is None:
        node = Node(name=name, state=NodeState.READY, created_at=now)
        session.add(node)
    elif node.state == NodeState.DOWN:
        node.state = NodeState.READY
    node.gpu_type, node.gpus, node.link_domain = acc.name, gpus, domain
    node.backend, node.labels, node.heartbeat_at = backend, labels or {}, now
    node.cpu_milli, node.memory_mib = cpu_milli, memory_mib
    session.flush()
    return node


def list_(session: Session, who: Principal) -> list[NodePublic]:
    nodes = session.scalars(select(Node).order_by(Node.name)).all()
    used = allocated(session)
    return [public(n, used.get(n.id, Allocated())) for n in nodes]


def set_state(session: Session, who: Principal, name: str, state: NodeState) -> NodePublic:
    """Cordon (take no new work) or uncordon a node; operators only."""
    who.require_operator()
    node = session.scalar(select(Node).where(Node.name == name))
    if node is None:
        raise NotFoundError(f"no node {name!r}")
    node.state = state
    audit.record(
        session,
        who,
        f"node.{'cordon' if state == NodeState.CORDONED else 'uncordon'}",
        f"node/{name}",
    )
    return public(node, allocated(session).get(node.id, Allocated()))


@dataclass(slots=True)
class Allocated:
    gpus: int = 0
    cpu_milli: int = 0
    memory_mib: int = 0


def allocated(session: Session) -> dict[int, Allocated]:
    """GPUs, CPU and memory in use per node id, by running jobs and live replicas (a
    workload runs on one node, so it holds all it requested there)."""
    used: dict[int, Allocated] = {}
    jobs = session.execute(
        select(Job.node_id, Job.devices, Job.cpu_milli, Job.memory_mib).where(
            Job.state == JobState.RUNNING
        )
    )
    replicas = session.execute(
        select(Replica.node_id, Replica.devices, Deployment.cpu_milli, Deployment.memory_mib)
        .join(Deployment, Replica.deployment_id == Deployment.id)
        .where(Replica.state.in_(REPLICA_HOLDS_GPUS))
    )
    for node_id, devices, cpu, mem in [*jobs, *replicas]:
        if node_id is not None:
            a = used.setdefault(node_id, Allocated())
            a.gpus += len(devices)
            a.cpu_milli += cpu
            a.memory_mib += mem
    return used


def public(node: Node, used: Allocated) -> NodePublic:
    return NodePublic(
        id=node.id,
        name=node.name,
        gpu_type=node.gpu_type,
        gpus=node.gpus,
        gpus_allocated=used.gpus,
        cpus=capacity.cpus(node.cpu_milli),
        cpus_allocated=capacity.cpus(used.cpu_milli),
        memory_gib=capacity.gib(node.memory_mib),
        memory_gib_allocated=capacity.gib(used.memory_mib),
        link_domain=node.link_domain,
        backend=node.backend,
        labels=node.labels,
        state=node.state,
        heartbeat_at=node.heartbeat_at,
    )
