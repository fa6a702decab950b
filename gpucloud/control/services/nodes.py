"""Nodes: the machines whose accelerators the control plane hands out."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sqlalchemy import literal, select
from sqlalchemy.orm import Session

from gpucloud import hardware
from gpucloud.control.auth import Principal
from gpucloud.control.errors import ConflictError
from gpucloud.control.executors.base import NodeInfo
from gpucloud.control.lifecycle import REPLICA_HOLDS_GPUS, JobState, NodeState
from gpucloud.control.models import Deployment, Job, Node, Replica
from gpucloud.control.schemas import NodePublic, gpus_of
from gpucloud.control.services import audit, capacity
from gpucloud.errors import ConfigError, NotFoundError
from gpucloud.scheduler.state import MILLI

log = logging.getLogger(__name__)


def names(session: Session) -> dict[int, str]:
    """Node id → name, for the public views of jobs and deployments."""
    return dict(session.execute(select(Node.id, Node.name)).all())


def sync(session: Session, inventory: list[NodeInfo], now: float, timeout: float) -> list[str]:
    """Bring the store's nodes in line with what the executor reports: a new node is
    registered, a known one refreshed (type, counts, address, heartbeat); one reported
    unhealthy, or not reported for `timeout` seconds, goes DOWN with the time and reason; a
    DOWN one reported healthy is READY again (a cordoned or draining one stays so). Both
    changes are audited, as the control plane's own acts.
    Returns the names of the nodes that went DOWN in this call."""
    known = {n.name: n for n in session.scalars(select(Node))}
    reported = set()
    down = []
    for info in inventory:
        try:
            acc, domain = _accelerators(info)
        except ConfigError as e:  # the engine's word against the catalog: not schedulable
            log.warning("node %s ignored: %s", info.name, e)
            continue
        reported.add(info.name)
        node = known.get(info.name) or _new(session, info.name, now)
        _refresh(node, info, acc.name, domain, now)
        if not info.healthy:
            down += _set_down(
                session, node, info.reason or "reported unhealthy by its executor", now
            )
        elif node.state == NodeState.DOWN:
            node.state, node.reason, node.state_since = NodeState.READY, None, now
            audit.record(session, None, "node.up", f"node/{node.name}")
    for name, node in known.items():
        if name not in reported and now - node.heartbeat_at > timeout:
            down += _set_down(session, node, f"not reported for {timeout:g} s", now)
    session.flush()
    return down


def _new(session: Session, name: str, now: float) -> Node:
    node = Node(name=name, state=NodeState.READY, created_at=now, state_since=now)
    node.heartbeat_at = now
    session.add(node)
    return node


def _accelerators(info: NodeInfo) -> tuple[hardware.Accelerator, int]:
    """The catalog entry of the node's accelerators, and its GPUs per link domain."""
    acc = hardware.get(info.gpu_type)
    if info.gpus < 1:
        raise ConfigError(f"node {info.name} must have at least 1 GPU, got {info.gpus}")
    domain = min(acc.link_domain, info.gpus)
    while info.gpus % domain:  # the catalog's domain may not divide an odd-sized machine
        domain -= 1
    return acc, domain


def _refresh(node: Node, info: NodeInfo, gpu_type: str, domain: int, now: float) -> None:
    node.gpu_type, node.gpus, node.link_domain = gpu_type, info.gpus, domain
    node.backend, node.labels, node.address = info.backend, info.labels, info.address
    node.cpu_milli, node.memory_mib = info.cpu_milli, info.memory_mib
    if info.healthy:
        node.heartbeat_at = now


def _set_down(session: Session, node: Node, reason: str, now: float) -> list[str]:
    if node.state == NodeState.DOWN:
        return []
    node.state, node.reason, node.state_since = NodeState.DOWN, reason, now
    audit.record(session, None, "node.down", f"node/{node.name}", reason=reason)
    return [node.name]


def list_(session: Session, who: Principal) -> list[NodePublic]:
    nodes = session.scalars(select(Node).order_by(Node.name)).all()
    used = allocated(session)
    return [public(n, used.get(n.name, Allocated())) for n in nodes]


# What an operator may do to a node: the state it goes to, and the audit action.
ACTIONS = {
    "cordon": NodeState.CORDONED,
    "drain": NodeState.DRAINING,
    "uncordon": NodeState.READY,
}


def set_state(session: Session, who: Principal, name: str, action: str) -> NodePublic:
    """Cordon (take no new work), drain (take no new work, move its replicas elsewhere,
    let its jobs finish) or uncordon (take work again) a node; operators only, audited. A
    node that is down stays down until its executor reports it healthy."""
    who.require_operator()
    node = session.scalar(select(Node).where(Node.name == name))
    if node is None:
        raise NotFoundError(f"no node {name!r}")
    if node.state == NodeState.DOWN:
        raise ConflictError(f"node {name} is down ({node.reason}): it cannot be {action}ed")
    if node.state != ACTIONS[action]:
        node.state, node.reason, node.state_since = ACTIONS[action], None, time.time()
    audit.record(session, who, f"node.{action}", f"node/{name}")
    return public(node, allocated(session).get(node.name, Allocated()))


@dataclass(slots=True)
class Allocated:
    gpu_milli: int = 0  # shares of a GPU count as such
    cpu_milli: int = 0
    memory_mib: int = 0


def allocated(session: Session) -> dict[str, Allocated]:
    """GPUs, CPU and memory in use per node name, by running jobs and live replicas: the
    GPUs of each node of a workload's placement, its CPU and memory on its first node."""
    used: dict[str, Allocated] = {}
    jobs = session.execute(
        select(Job.placement, Job.cpu_milli, Job.memory_mib, Job.gpu_milli).where(
            Job.state == JobState.RUNNING
        )
    )
    replicas = session.execute(
        select(Replica.placement, Deployment.cpu_milli, Deployment.memory_mib, literal(MILLI))
        .join(Deployment, Replica.deployment_id == Deployment.id)
        .where(Replica.state.in_(REPLICA_HOLDS_GPUS))
    )
    for placement, cpu, mem, milli in [*jobs, *replicas]:
        for i, part in enumerate(placement or []):
            a = used.setdefault(part["node"], Allocated())
            a.gpu_milli += len(part["devices"]) * milli
            if i == 0:
                a.cpu_milli += cpu
                a.memory_mib += mem
    return used


def public(node: Node, used: Allocated) -> NodePublic:
    return NodePublic(
        id=node.id,
        name=node.name,
        gpu_type=node.gpu_type,
        gpus=node.gpus,
        gpus_allocated=gpus_of(used.gpu_milli),
        cpus=capacity.cpus(node.cpu_milli),
        cpus_allocated=capacity.cpus(used.cpu_milli),
        memory_gib=capacity.gib(node.memory_mib),
        memory_gib_allocated=capacity.gib(used.memory_mib),
        link_domain=node.link_domain,
        backend=node.backend,
        labels=node.labels,
        state=node.state,
        reason=node.reason,
        state_since=node.state_since,
        address=node.address,
        heartbeat_at=node.heartbeat_at,
    )
