"""/api/v1/tenants/{tenant}/keys: a tenant's API keys."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request

from gpucloud.control.deps import Caller, Db, after_commit
from gpucloud.control.schemas import KeyCreate, KeyCreated, KeyPublic, KeyRotate, KeyUpdate
from gpucloud.control.services import keys as service

router = APIRouter(prefix="/tenants/{tenant}/keys", tags=["keys"])
TenantName = Annotated[str, Path(max_length=63)]
KeyName = Annotated[str, Path(max_length=63)]


def _forget_routes(request: Request, db: Db) -> None:
    # The gateway caches which key reaches which replicas: once the change is committed,
    # it must read the store again, or a revoked key would work until its route expires.
    after_commit(db, request.app.state.gateway.forget_routes)


@router.post("", response_model=KeyCreated, status_code=201)
def create_key(tenant: TenantName, spec: KeyCreate, db: Db, who: Caller) -> KeyCreated:
    """A new key; its secret (`api_key`) is in this answer only."""
    return service.create(db, who, tenant, spec)


@router.get("", response_model=list[KeyPublic])
def list_keys(tenant: TenantName, db: Db, who: Caller) -> list[KeyPublic]:
    """The tenant's working keys: names and prefixes, never secrets."""
    return service.list_(db, who, tenant)


@router.patch("/{name}", response_model=list[KeyPublic])
def update_key(
    tenant: TenantName, name: KeyName, spec: KeyUpdate, db: Db, who: Caller, request: Request
) -> list[KeyPublic]:
    """Change a key's priority class or rate limit; the gateway applies it at once."""
    _forget_routes(request, db)
    return service.update(db, who, tenant, name, spec)


@router.delete("/{name}", response_model=list[KeyPublic])
def revoke_key(
    tenant: TenantName, name: KeyName, db: Db, who: Caller, request: Request
) -> list[KeyPublic]:
    """Revoke a key (and a key it replaced that is still in its grace period): every API
    refuses it from the moment this answers."""
    _forget_routes(request, db)
    return service.revoke(db, who, tenant, name)


@router.post("/{name}/rotate", response_model=KeyCreated, status_code=201)
def rotate_key(
    tenant: TenantName,
    name: KeyName,
    db: Db,
    who: Caller,
    request: Request,
    body: KeyRotate | None = None,
) -> KeyCreated:
    """A new key under the same name; the old one works for `grace_seconds` more (default
    24 h). The new secret is in this answer only."""
    _forget_routes(request, db)
    return service.rotate(db, who, tenant, name, (body or KeyRotate()).grace_seconds)
