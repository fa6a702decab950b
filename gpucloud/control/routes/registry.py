"""/api/v1/models: the model registry (services/registry.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from gpucloud.control.deps import Caller, Db
from gpucloud.control.registry_schemas import (
    EvalPublic,
    EvalSubmit,
    ModelHistory,
    ModelRegister,
    ModelSummary,
    ModelVersionPublic,
)
from gpucloud.control.schemas import Name
from gpucloud.control.services import registry as service

router = APIRouter(tags=["models"])
ModelName = Annotated[str, Path(max_length=63)]
Version = Annotated[str, Path(pattern=r"^(\d{1,9}|latest)$", description="a number, or latest")]
TenantName = Annotated[
    str | None, Query(max_length=63, description="operators: another tenant's model")
]


@router.post("/models/{name}/versions", response_model=ModelVersionPublic, status_code=201)
def register(name: Name, spec: ModelRegister, db: Db, who: Caller, response: Response):
    """Register a version of `name` (201), or return the version with the same content (200)."""
    v = service.register(db, who, name, spec)
    if not v.created:
        response.status_code = 200
    return v


@router.get("/models", response_model=list[ModelSummary])
def list_models(db: Db, who: Caller) -> list[ModelSummary]:
    return service.list_(db, who)


@router.get("/models/{name}/versions/{version}", response_model=ModelVersionPublic)
def get(
    name: ModelName, version: Version, db: Db, who: Caller, tenant: TenantName = None
) -> ModelVersionPublic:
    return service.get(db, who, name, version, tenant)


@router.get("/models/{name}/history", response_model=ModelHistory)
def history(name: ModelName, db: Db, who: Caller, tenant: TenantName = None) -> ModelHistory:
    """Its versions with their lineage and eval results."""
    return service.history(db, who, name, tenant)


@router.post("/models/{name}/versions/{version}/evals", response_model=EvalPublic)
def record_eval(
    name: ModelName, version: Version, result: EvalSubmit, db: Db, who: Caller
) -> EvalPublic:
    """Store a `gpucloud eval --json` result on the version (replacing one of the same task
    file)."""
    return service.record_eval(db, who, name, version, result)
