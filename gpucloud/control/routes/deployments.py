"""/api/v1/deployments."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from gpucloud.control.deps import Caller, Db, Wake
from gpucloud.control.schemas import (
    DeploymentHistory,
    DeploymentPublic,
    DeploymentScale,
    DeploymentSpec,
    DeploymentUpdate,
    RolloutSpec,
)
from gpucloud.control.services import deployments as service

router = APIRouter(tags=["deployments"])
DeploymentName = Annotated[str, Path(max_length=63)]


@router.post("/deployments", response_model=DeploymentPublic, status_code=201, dependencies=[Wake])
def create(spec: DeploymentSpec, db: Db, who: Caller) -> DeploymentPublic:
    return service.create(db, who, spec)


@router.get("/deployments", response_model=list[DeploymentPublic])
def list_deployments(db: Db, who: Caller) -> list[DeploymentPublic]:
    return service.list_(db, who)


@router.get("/deployments/{name}", response_model=DeploymentPublic)
def get(name: DeploymentName, db: Db, who: Caller) -> DeploymentPublic:
    return service.public(db, service.get(db, who, name), who.tenant_name)


@router.post("/deployments/{name}/scale", response_model=DeploymentPublic, dependencies=[Wake])
def scale(name: DeploymentName, body: DeploymentScale, db: Db, who: Caller) -> DeploymentPublic:
    return service.scale(db, who, name, body.replicas)


@router.patch("/deployments/{name}", response_model=DeploymentPublic, dependencies=[Wake])
def update(name: DeploymentName, change: DeploymentUpdate, db: Db, who: Caller) -> DeploymentPublic:
    """Change its warm pool (replicas loaded but not routed, promoted first on a scale-up)."""
    return service.update(db, who, name, change)


@router.post("/deployments/{name}/rollout", response_model=DeploymentPublic, dependencies=[Wake])
def rollout(name: DeploymentName, spec: RolloutSpec, db: Db, who: Caller) -> DeploymentPublic:
    """Start a new version beside the stable one, with `canary` percent of the requests."""
    return service.rollout(db, who, name, spec)


@router.post("/deployments/{name}/promote", response_model=DeploymentPublic, dependencies=[Wake])
def promote(name: DeploymentName, db: Db, who: Caller) -> DeploymentPublic:
    """Make the canary the stable version; the old one drains, then stops."""
    return service.promote(db, who, name)


@router.post("/deployments/{name}/rollback", response_model=DeploymentPublic, dependencies=[Wake])
def rollback(name: DeploymentName, db: Db, who: Caller) -> DeploymentPublic:
    """End the canary: it drains, then stops; the stable version takes every request."""
    return service.rollback(db, who, service.active(db, who, name), "rolled back by hand")


@router.get("/deployments/{name}/history", response_model=DeploymentHistory)
def history(name: DeploymentName, db: Db, who: Caller) -> DeploymentHistory:
    """Its versions, and its traffic split after each change."""
    return service.history(db, who, name)


@router.delete("/deployments/{name}", response_model=DeploymentPublic, dependencies=[Wake])
def delete(name: DeploymentName, db: Db, who: Caller) -> DeploymentPublic:
    return service.delete(db, who, name)
