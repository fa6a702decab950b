"""/api/v1/deployments."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from gpucloud.control.deps import Caller, Db, Wake
from gpucloud.control.schemas import DeploymentPublic, DeploymentScale, DeploymentSpec
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


@router.delete("/deployments/{name}", response_model=DeploymentPublic, dependencies=[Wake])
def delete(name: DeploymentName, db: Db, who: Caller) -> DeploymentPublic:
    return service.delete(db, who, name)
