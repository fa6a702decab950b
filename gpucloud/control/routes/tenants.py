"""/api/v1/tenants, /api/v1/users, /api/v1/me and /api/v1/audit."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request

from gpucloud.control.deps import Caller, Db, after_commit
from gpucloud.control.schemas import (
    AuditPublic,
    CohortSet,
    Me,
    QuotaSet,
    RateLimit,
    TenantCreate,
    TenantCreated,
    TenantIdleTtl,
    TenantPublic,
    UserCreate,
    UserCreated,
)
from gpucloud.control.services import audit
from gpucloud.control.services import tenants as service

router = APIRouter(tags=["tenants"])
TenantName = Annotated[str, Path(max_length=63)]


@router.get("/me", response_model=Me)
def me(who: Caller) -> Me:
    return Me(
        tenant=who.tenant_name, user=who.user_name, role=who.role, is_operator=who.is_operator
    )


@router.post("/tenants", response_model=TenantCreated, status_code=201)
def create_tenant(spec: TenantCreate, db: Db, who: Caller) -> TenantCreated:
    return service.create(db, who, spec)


@router.get("/tenants", response_model=list[TenantPublic])
def list_tenants(db: Db, who: Caller) -> list[TenantPublic]:
    return service.list_(db, who)


@router.get("/tenants/{name}", response_model=TenantPublic)
def get_tenant(name: TenantName, db: Db, who: Caller) -> TenantPublic:
    return service.public(db, service.get(db, who, name))


@router.put("/tenants/{name}/quotas/{gpu_type}", response_model=TenantPublic)
def set_quota(
    name: TenantName,
    gpu_type: Annotated[str, Path(max_length=64)],
    body: QuotaSet,
    db: Db,
    who: Caller,
) -> TenantPublic:
    return service.set_quota(db, who, name, gpu_type, body.gpus)


@router.put("/tenants/{name}/rate-limit", response_model=TenantPublic)
def set_rate_limit(
    name: TenantName, body: RateLimit, db: Db, who: Caller, request: Request
) -> TenantPublic:
    """Requests and tokens per minute the tenant may send through /v1 ({} lifts them)."""
    after_commit(db, request.app.state.gateway.forget_routes)  # routes carry the limits
    return service.set_rate_limit(db, who, name, body)


@router.put("/tenants/{name}/cohort", response_model=TenantPublic)
def set_cohort(name: TenantName, body: CohortSet, db: Db, who: Caller) -> TenantPublic:
    """Lend and borrow idle quota within a cohort of tenants (null leaves it)."""
    return service.set_cohort(db, who, name, body.cohort)


@router.put("/tenants/{name}/idle-ttl", response_model=TenantPublic)
def set_idle_ttl(name: TenantName, body: TenantIdleTtl, db: Db, who: Caller) -> TenantPublic:
    """How long its deployments and interactive jobs may sit idle (null: the cluster's)."""
    return service.set_idle_ttl(db, who, name, body.idle_ttl)


@router.post("/users", response_model=UserCreated, status_code=201)
def create_user(spec: UserCreate, db: Db, who: Caller) -> UserCreated:
    return service.create_user(db, who, spec)


@router.get("/audit", response_model=list[AuditPublic])
def audit_log(
    db: Db, who: Caller, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> list[AuditPublic]:
    return audit.entries(db, who, limit)
