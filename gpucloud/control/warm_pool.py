"""The warm pool: replicas started with their weights loaded but not routed, so that a
scale-up (from zero, or by the autoscaler) gets a replica that is ready at once.

A deployment with a warm pool of N keeps N replicas of its stable version beyond the ones
it routes: the version's replicas 0..routed-1 serve (READY once ready), the next N wait
(WARM once ready: probed like READY ones, but out of the gateway's routes and not counted
as serving capacity). A warm replica is placed and holds its GPUs like any other, so it
counts against its tenant's quota and budget.

On every resize `arrange` moves replicas between the two groups: a scale-up promotes WARM
ones to READY in the same transaction (the gateway routes them on its next look, instead
of waiting for a process to start and load its weights), and the pool is refilled with new
replicas behind them; a scale-down demotes READY ones back to WARM rather than stopping
them (their requests in flight still finish). A deployment reclaimed as idle
(control/idle.py) keeps no pool: reclaiming is for freeing its GPUs.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from gpucloud.control.lifecycle import ReplicaState, VersionState, check_replica_transition
from gpucloud.control.models import Deployment, DeploymentVersion, Replica
from gpucloud.control.services import versions

_NOT_READY_YET = frozenset(
    {ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.RESTARTING, ReplicaState.FAILED}
)


def size(warm_pool: int, reclaimed_replicas: int | None) -> int:
    """The warm replicas a deployment keeps now: its pool, none while reclaimed as idle."""
    return 0 if reclaimed_replicas is not None else warm_pool


def kept(routed: int, version_state: str, pool: int) -> int:
    """The replicas a version keeps running: those it routes, plus the pool if stable."""
    return routed + pool if version_state == VersionState.STABLE else routed


def ready_state(session: Session, replica: Replica) -> ReplicaState:
    """What `replica` becomes once it answers /ready: READY if its version routes it, else
    WARM (one of the pool's)."""
    dep = session.get(Deployment, replica.deployment_id)
    version = session.get(DeploymentVersion, replica.version_id)
    routed = versions.wanted(dep.replicas, version.state, version.percent)
    return ReplicaState.READY if replica.index < routed else ReplicaState.WARM


def arrange(replicas: list[Replica], routed: int, kept_: int) -> None:
    """Sort one version's live replicas into the `routed` ones and the pool up to `kept_`.

    A routed place whose replica is not ready yet (or has none) takes a WARM replica from
    the pool instead (they swap indexes), so a scale-up is served by a process already
    loaded; then the routed WARM ones become READY and the READY ones in the pool WARM.
    Replicas past `kept_` are left as they are: the reconciler stops them.
    """
    by_index = {r.index: r for r in replicas}
    pool = sorted(
        (r for r in replicas if routed <= r.index < kept_ and r.state == ReplicaState.WARM),
        key=lambda r: r.index,
    )
    for index in range(routed):
        slow = by_index.get(index)
        if pool and (slow is None or slow.state in _NOT_READY_YET):
            warm = pool.pop(0)
            if slow is not None:
                slow.index = warm.index
            warm.index = index
    for r in replicas:
        if r.index < routed and r.state == ReplicaState.WARM:
            _set(r, ReplicaState.READY)
        elif routed <= r.index < kept_ and r.state == ReplicaState.READY:
            _set(r, ReplicaState.WARM)


def _set(replica: Replica, to: ReplicaState) -> None:
    check_replica_transition(replica.id, replica.state, to)
    replica.state = to
