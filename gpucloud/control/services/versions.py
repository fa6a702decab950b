"""Deployment versions: roll a new one out as a canary, then promote it or roll it back.

A rollout adds version N+1 beside the stable one with `percent` of the requests (the
gateway's choice: control/traffic.py). Its replicas follow that share of the deployment's
replicas (`wanted`). Promoting makes it the stable version, rolling it back ends it; either
way the version that ends leaves the gateway's routes at once and its replicas are stopped
once the requests they have are done (the reconciler asks the gateway: `Gateway.drained`).
Every step is audited with the traffic split it leaves, which is the deployment's history.
"""

from __future__ import annotations

import math
import time

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpucloud.control.auth import Principal
from gpucloud.control.errors import ConflictError
from gpucloud.control.lifecycle import (
    SERVED_VERSIONS,
    Role,
    VersionState,
    check_version_transition,
)
from gpucloud.control.models import AuditEntry, Deployment, DeploymentVersion, User
from gpucloud.control.schemas import (
    DeploymentHistory,
    RolloutSpec,
    TrafficEvent,
    VersionPublic,
)
from gpucloud.control.services import audit, eval_gate, registry

# Audit actions that change the traffic split; each entry carries the split it leaves.
TRAFFIC_ACTIONS = ("create", "rollout", "promote", "rollback")


def wanted(deployment_replicas: int, state: str, percent: float) -> int:
    """The replicas a version wants: the stable one the deployment's; a canary its share of
    those, at least one while the deployment has any; an ended version none."""
    if state == VersionState.STABLE:
        return deployment_replicas
    if state == VersionState.CANARY and deployment_replicas:
        return max(1, math.ceil(deployment_replicas * percent / 100 - 1e-9))
    return 0


def first(session: Session, dep: Deployment, served: registry.Served) -> DeploymentVersion:
    """Version 1 of a new deployment: its own model and engine settings, stable."""
    v = DeploymentVersion(
        deployment_id=dep.id,
        number=1,
        model_dir=served.model_dir,
        model_version_id=served.version_id,
        model_ref=served.ref,
        engine_args=dep.engine_args,
        command=dep.command,
        state=VersionState.STABLE,
        percent=100.0,
        created_at=dep.created_at,
    )
    session.add(v)
    session.flush()
    return v


def served(session: Session, dep_id: int) -> dict[str, DeploymentVersion]:
    """The deployment's stable version, and its canary if it has one, by state."""
    rows = session.scalars(
        select(DeploymentVersion).where(
            DeploymentVersion.deployment_id == dep_id,
            DeploymentVersion.state.in_(SERVED_VERSIONS),
        )
    )
    return {v.state: v for v in rows}


def traffic(session: Session, dep_id: int) -> dict[str, float]:
    """Version number (as a string, as in JSON) -> percent of the requests it gets."""
    return {str(v.number): v.percent for v in served(session, dep_id).values()}


def rollout(session: Session, who: Principal, dep: Deployment, spec: RolloutSpec) -> None:
    """Start version N+1 beside the stable one with `spec.canary` percent of the requests.
    Raises ConflictError if the deployment already has a canary, or if its promotion is to
    require an eval and the stable version is no registered model to compare with."""
    who.require(Role.MEMBER)
    versions = served(session, dep.id)
    if (canary := versions.get(VersionState.CANARY)) is not None:
        raise ConflictError(
            f"deployment {dep.name!r} already has a canary, version {canary.number}: promote "
            "it or roll it back first"
        )
    model = registry.served_model(session, who, spec)
    if spec.require_eval is not None:
        eval_gate.check_comparable(dep, versions[VersionState.STABLE])
    number = session.scalar(
        select(func.max(DeploymentVersion.number)).where(DeploymentVersion.deployment_id == dep.id)
    )
    new = DeploymentVersion(
        deployment_id=dep.id,
        number=(number or 0) + 1,
        model_dir=model.model_dir,
        model_version_id=model.version_id,
        model_ref=model.ref,
        require_eval=spec.require_eval.model_dump() if spec.require_eval else None,
        engine_args=spec.engine_args,
        command=spec.command,
        state=VersionState.CANARY,
        percent=spec.canary,
        guard=spec.guard.model_dump() if spec.guard else None,
        created_at=time.time(),
    )
    session.add(new)
    versions[VersionState.STABLE].percent = 100.0 - spec.canary
    session.flush()
    _audit(session, who, dep, "rollout", version=new.number, model_dir=model.model_dir,
           model=model.ref)  # fmt: skip


def promote(session: Session, who: Principal, dep: Deployment) -> None:
    """Make the canary the stable version; the old stable one drains and stops. Raises
    ConflictError when the canary requires an eval that it does not pass (eval_gate)."""
    who.require(Role.MEMBER)
    canary, stable = _canary(session, dep, "promote")
    verdict = eval_gate.check(session, dep, canary, stable)
    _end(stable, VersionState.RETIRED, f"replaced by version {canary.number}")
    check_version_transition(canary.number, canary.state, VersionState.STABLE)
    canary.state, canary.percent = VersionState.STABLE, 100.0
    dep.model_dir, dep.engine_args, dep.command = (
        canary.model_dir,
        canary.engine_args,
        canary.command,
    )
    session.flush()
    _audit(session, who, dep, "promote", version=canary.number, retired=stable.number,
           **({"eval": verdict} if verdict else {}))  # fmt: skip


def rollback(session: Session, who: Principal | None, dep: Deployment, reason: str) -> None:
    """End the canary (by `who`, or by the control plane itself when None): it drains and
    stops, the stable version takes every request."""
    if who is not None:
        who.require(Role.MEMBER)
    canary, stable = _canary(session, dep, "roll back")
    _end(canary, VersionState.ROLLED_BACK, reason)
    stable.percent = 100.0
    session.flush()
    _audit(session, who, dep, "rollback", version=canary.number, reason=reason)


def history(session: Session, dep: Deployment) -> DeploymentHistory:
    """Its versions, and each change of its traffic split, oldest first."""
    versions = session.scalars(
        select(DeploymentVersion)
        .where(DeploymentVersion.deployment_id == dep.id)
        .order_by(DeploymentVersion.number)
    )
    entries = session.execute(
        select(AuditEntry, User.name)
        .outerjoin(User, AuditEntry.user_id == User.id)
        .where(
            AuditEntry.tenant_id == dep.tenant_id,
            AuditEntry.target == f"deployment/{dep.name}",
            AuditEntry.at >= dep.created_at,  # not a deleted namesake's
        )
        .order_by(AuditEntry.id)
    )
    events = [
        TrafficEvent(
            at=e.at,
            action=e.action.removeprefix("deployment."),
            user=user,
            traffic=e.detail["traffic"],
            reason=e.detail.get("reason"),
        )
        for e, user in entries
        if "traffic" in e.detail
    ]
    return DeploymentHistory(name=dep.name, versions=[public(v) for v in versions], events=events)


def public(v: DeploymentVersion) -> VersionPublic:
    return VersionPublic.model_validate(v)


def _canary(
    session: Session, dep: Deployment, verb: str
) -> tuple[DeploymentVersion, DeploymentVersion]:
    versions = served(session, dep.id)
    if VersionState.CANARY not in versions:
        raise ConflictError(
            f"deployment {dep.name!r} has no canary to {verb} (its stable version is "
            f"{versions[VersionState.STABLE].number}): start one with `gpucloud deploy rollout`"
        )
    return versions[VersionState.CANARY], versions[VersionState.STABLE]


def _end(v: DeploymentVersion, to: VersionState, reason: str) -> None:
    check_version_transition(v.number, v.state, to)
    v.state, v.percent, v.ended_at, v.reason = to, 0.0, time.time(), reason


def _audit(session: Session, who: Principal | None, dep: Deployment, action: str, **detail) -> None:
    audit.record(session, who, f"deployment.{action}", f"deployment/{dep.name}",
                 tenant_id=dep.tenant_id, traffic=traffic(session, dep.id),
                 **detail)  # fmt: skip
