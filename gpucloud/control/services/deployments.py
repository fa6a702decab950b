"""Deployments: N replicas of a model server, each admitted through the scheduler like a job.

Each replica serves one version of its deployment (services/versions.py): the stable one,
or a canary rolled out beside it."""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.control import idle_policy, warm_pool
from gpucloud.control.auth import Principal
from gpucloud.control.errors import ConflictError
from gpucloud.control.lifecycle import (
    ReplicaState,
    Role,
    VersionState,
    check_replica_transition,
)
from gpucloud.control.models import Deployment, DeploymentVersion, Replica, Tenant
from gpucloud.control.schemas import (
    Autoscale,
    DeploymentHistory,
    DeploymentPublic,
    DeploymentSpec,
    DeploymentUpdate,
    ReplicaPublic,
    RolloutSpec,
)
from gpucloud.control.services import audit, capacity, nodes, registry, versions
from gpucloud.errors import NotFoundError

ACTIVE, DELETING, DELETED = "active", "deleting", "deleted"


def create(session: Session, who: Principal, spec: DeploymentSpec) -> DeploymentPublic:
    """Create a deployment. Raises CapacityError when one replica, or as many as it may
    want (its replicas, or max_replicas if autoscaled, and its warm pool), could never run
    here."""
    who.require(Role.MEMBER)
    served = registry.served_model(session, who, spec)
    clash = select(Deployment.id).where(
        Deployment.tenant_id == who.tenant_id,
        Deployment.name == spec.name,
        Deployment.state != DELETED,
    )
    if session.scalar(clash):
        raise ConflictError(f"deployment {spec.name!r} already exists")
    req = capacity.Request.of(spec.gpus_per_replica, spec.gpu_type, spec.cpus, spec.memory_gib)
    capacity.check_admissible(session, who.tenant_id, req)
    most = spec.autoscale.max_replicas if spec.autoscale else spec.replicas
    capacity.check_replicas(session, who.tenant_id, req, most + spec.warm_pool)
    dep = Deployment(
        tenant_id=who.tenant_id,
        user_id=who.user_id,
        name=spec.name,
        model_dir=served.model_dir,
        engine_args=spec.engine_args,
        command=spec.command,
        replicas=_within(spec.replicas, spec.autoscale),
        autoscale=spec.autoscale.model_dump() if spec.autoscale else None,
        warm_pool=spec.warm_pool,
        gpus_per_replica=spec.gpus_per_replica,
        gpu_type=spec.gpu_type,
        cpu_milli=req.cpu_milli,
        memory_mib=req.memory_mib,
        priority=spec.priority,
        preemptible=spec.preemptible,
        env=spec.env,
        batch_in_flight=spec.batch_in_flight,
        state=ACTIVE,
        created_at=time.time(),
        labels=spec.labels,
        idle_ttl=spec.idle_ttl,
    )
    session.add(dep)
    session.flush()
    versions.first(session, dep, served)
    _resize(session, dep)
    audit.record(
        session,
        who,
        "deployment.create",
        f"deployment/{dep.name}",
        replicas=spec.replicas,
        model_dir=served.model_dir,
        model=served.ref,
        traffic=versions.traffic(session, dep.id),
    )
    return public(session, dep, who.tenant_name)


def list_(session: Session, who: Principal) -> list[DeploymentPublic]:
    return list_of(session, [who.tenant_id])


def list_of(session: Session, tenant_ids: list[int] | None) -> list[DeploymentPublic]:
    """The live deployments of `tenant_ids` (of every tenant if None), for a caller allowed
    to read them (accounting.visible_tenants)."""
    q = (
        select(Deployment, Tenant.name)
        .join(Tenant, Deployment.tenant_id == Tenant.id)
        .where(Deployment.state != DELETED)
        .order_by(Deployment.id)
    )
    if tenant_ids is not None:
        q = q.where(Deployment.tenant_id.in_(tenant_ids))
    return [public(session, d, tenant) for d, tenant in session.execute(q)]


def get(session: Session, who: Principal, name: str) -> Deployment:
    """The caller's live deployment `name` (another tenant's is NotFoundError)."""
    dep = session.scalar(
        select(Deployment).where(
            Deployment.tenant_id == who.tenant_id,
            Deployment.name == name,
            Deployment.state != DELETED,
        )
    )
    if dep is None:
        raise NotFoundError(f"no deployment {name!r}")
    return dep


def active(session: Session, who: Principal, name: str) -> Deployment:
    """The caller's deployment `name`, not being deleted (else ConflictError)."""
    dep = get(session, who, name)
    if dep.state != ACTIVE:
        raise ConflictError(f"deployment {name!r} is being deleted")
    return dep


def scale(session: Session, who: Principal, name: str, replicas: int) -> DeploymentPublic:
    """Set the replicas of a deployment not autoscaled. Raises CapacityError when that many
    could never run here."""
    who.require(Role.MEMBER)
    dep = active(session, who, name)
    if dep.autoscale:
        a = Autoscale(**dep.autoscale)
        raise ConflictError(
            f"deployment {name!r} is autoscaled ({a.min_replicas} to {a.max_replicas} "
            "replicas by its load): its replicas are not set by hand"
        )
    req = capacity.Request(dep.gpus_per_replica, dep.gpu_type, dep.cpu_milli, dep.memory_mib)
    capacity.check_replicas(session, who.tenant_id, req, replicas)
    dep.reclaimed_replicas = dep.idle_reclaim_at = None  # set by hand: no longer idle's
    resize(session, dep, replicas)
    audit.record(session, who, "deployment.scale", f"deployment/{name}", replicas=replicas)
    return public(session, dep, who.tenant_name)


def update(
    session: Session, who: Principal, name: str, change: DeploymentUpdate
) -> DeploymentPublic:
    """Change what `change` sets. Raises CapacityError when the replicas it may want and
    the new warm pool could never run here."""
    who.require(Role.MEMBER)
    dep = active(session, who, name)
    if change.warm_pool is not None:
        req = capacity.Request(dep.gpus_per_replica, dep.gpu_type, dep.cpu_milli, dep.memory_mib)
        most = Autoscale(**dep.autoscale).max_replicas if dep.autoscale else dep.replicas
        capacity.check_replicas(session, who.tenant_id, req, most + change.warm_pool)
        dep.warm_pool = change.warm_pool
        _resize(session, dep)
    audit.record(session, who, "deployment.update", f"deployment/{name}",
                 **change.model_dump(exclude_none=True))  # fmt: skip
    return public(session, dep, who.tenant_name)


def rollout(session: Session, who: Principal, name: str, spec: RolloutSpec) -> DeploymentPublic:
    """Start a new version of `name` as a canary (versions.rollout)."""
    dep = active(session, who, name)
    versions.rollout(session, who, dep, spec)
    _resize(session, dep)
    return public(session, dep, who.tenant_name)


def promote(session: Session, who: Principal, name: str) -> DeploymentPublic:
    """Make the canary of `name` its stable version (versions.promote)."""
    dep = active(session, who, name)
    versions.promote(session, who, dep)
    _resize(session, dep)
    return public(session, dep, who.tenant_name)


def rollback(
    session: Session, who: Principal | None, dep: Deployment, reason: str
) -> DeploymentPublic | None:
    """End the canary of `dep` (versions.rollback): by `who`, or by the control plane."""
    versions.rollback(session, who, dep, reason)
    _resize(session, dep)
    return public(session, dep, who.tenant_name) if who is not None else None


def history(session: Session, who: Principal, name: str) -> DeploymentHistory:
    return versions.history(session, get(session, who, name))


def delete(session: Session, who: Principal, name: str) -> DeploymentPublic:
    """Mark the deployment for deletion; the reconciler stops its replicas, then drops it."""
    who.require(Role.MEMBER)
    dep = get(session, who, name)
    dep.state = DELETING
    dep.replicas = 0
    audit.record(session, who, "deployment.delete", f"deployment/{name}")
    return public(session, dep, who.tenant_name)


def live_replicas(session: Session, dep: Deployment) -> list[Replica]:
    return list(
        session.scalars(
            select(Replica)
            .where(Replica.deployment_id == dep.id, Replica.state != ReplicaState.STOPPED)
            .order_by(Replica.version_id, Replica.index)
        )
    )


def set_replica_state(replica: Replica, to: ReplicaState) -> None:
    check_replica_transition(replica.id, replica.state, to)
    replica.state = to


def resize(session: Session, dep: Deployment, replicas: int) -> None:
    """Set the wanted replica count: by hand (`scale`) or by the autoscaler."""
    dep.replicas = replicas
    _resize(session, dep)


def _within(replicas: int, autoscale: Autoscale | None) -> int:
    if autoscale is None:
        return replicas
    return min(max(replicas, autoscale.min_replicas), autoscale.max_replicas)


def _resize(session: Session, dep: Deployment) -> None:
    """Give each version of `dep` PENDING replicas up to what it keeps (what it routes,
    versions.wanted, and the stable one's warm pool); the ones past it are stopped.

    The warm pool's replicas are first sorted out (warm_pool.arrange: a scale-up promotes
    WARM ones). Waiting replicas stop here at once; replicas with a process are left for
    the reconciler, which stops any replica whose index is past what its version keeps
    (one of a version that ended once the gateway has drained it).
    """
    live = live_replicas(session, dep)
    pool = warm_pool.size(dep.warm_pool, dep.reclaimed_replicas)
    wants = {}
    for v in session.scalars(
        select(DeploymentVersion).where(DeploymentVersion.deployment_id == dep.id)
    ):
        routed = versions.wanted(dep.replicas, v.state, v.percent)
        wants[v.id] = warm_pool.kept(routed, v.state, pool)
        warm_pool.arrange([r for r in live if r.version_id == v.id], routed, wants[v.id])
    for r in live:
        if r.index >= wants[r.version_id] and r.state in (
            ReplicaState.PENDING,
            ReplicaState.RESTARTING,
        ):
            set_replica_state(r, ReplicaState.STOPPED)
    taken = {(r.version_id, r.index) for r in live}
    for vid, n in wants.items():
        for index in range(n):
            if (vid, index) not in taken:
                session.add(
                    Replica(
                        deployment_id=dep.id,
                        version_id=vid,
                        index=index,
                        state=ReplicaState.PENDING,
                        devices=[],
                        restarts=0,
                        not_before=0.0,
                        created_at=time.time(),
                    )
                )
    session.flush()


def public(session: Session, dep: Deployment, tenant_name: str) -> DeploymentPublic:
    node_names = nodes.names(session)
    reps = live_replicas(session, dep)
    numbers = dict(
        session.execute(
            select(DeploymentVersion.id, DeploymentVersion.number).where(
                DeploymentVersion.deployment_id == dep.id
            )
        ).all()
    )
    served = versions.served(session, dep.id)
    serving = list(served.values())
    ids = {v.id for v in serving}  # an ended version's replicas drain: not counted
    canary = served.get(VersionState.CANARY)
    return DeploymentPublic(
        id=dep.id,
        tenant=tenant_name,
        name=dep.name,
        model_dir=dep.model_dir,
        engine_args=dep.engine_args,
        command=dep.command,
        replicas=dep.replicas,
        routed_replicas=sum(versions.wanted(dep.replicas, v.state, v.percent) for v in serving),
        ready_replicas=sum(r.state == ReplicaState.READY and r.version_id in ids for r in reps),
        warm_pool=dep.warm_pool,
        warm_replicas=sum(r.state == ReplicaState.WARM for r in reps),
        restarts=sum(r.restarts for r in reps),
        autoscale=Autoscale(**dep.autoscale) if dep.autoscale else None,
        gpus_per_replica=dep.gpus_per_replica,
        gpu_type=dep.gpu_type,
        cpus=capacity.cpus(dep.cpu_milli),
        memory_gib=capacity.gib(dep.memory_mib),
        priority=dep.priority,
        preemptible=dep.preemptible,
        batch_in_flight=dep.batch_in_flight,
        state=dep.state,
        created_at=dep.created_at,
        labels=dep.labels or {},
        idle_ttl=dep.idle_ttl,
        idle=idle_policy.deployment_notice(dep.idle_reclaim_at, dep.reclaimed_replicas),
        version=served[VersionState.STABLE].number,
        model=served[VersionState.STABLE].model_ref,
        canary=versions.public(canary) if canary else None,
        replica_list=[
            ReplicaPublic(
                id=r.id,
                index=r.index,
                state=r.state,
                node=node_names.get(r.node_id) if r.node_id else None,
                devices=r.devices,
                port=r.port,
                url=r.url,
                restarts=r.restarts,
                exit_code=r.exit_code,
                reason=r.reason,
                started_at=r.started_at,
                ready_at=r.ready_at,
                version=numbers[r.version_id],
            )
            for r in reps
        ],
    )
