"""A tenant's API keys: create, list, revoke, rotate (admins of the tenant, or operators).

A key acts as one user of its tenant. Names are unique among the tenant's live keys; a
rotated key keeps its name until its grace period ends, beside the key that replaced it.
Secrets are in the answer of create and rotate only; the store keeps their hashes.
"""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.control import auth
from gpucloud.control.auth import Principal
from gpucloud.control.errors import ConflictError
from gpucloud.control.lifecycle import Role
from gpucloud.control.models import ApiKey, Tenant, User
from gpucloud.control.schemas import KeyCreate, KeyCreated, KeyPublic, KeyUpdate
from gpucloud.control.services import audit, tenants
from gpucloud.errors import NotFoundError


def create(session: Session, who: Principal, tenant_name: str, spec: KeyCreate) -> KeyCreated:
    """A new key named `spec.name`. Raises ConflictError when a live key has that name."""
    tenant = _managed(session, who, tenant_name)
    user = _user(session, who, tenant, spec.user)
    if _live(session, tenant, spec.name):
        raise ConflictError(
            f"tenant {tenant.name} already has a key named {spec.name!r}: "
            "rotate it, revoke it, or pick another name"
        )
    row, secret = auth.issue_key(session, user, spec.name)
    row.priority_class = spec.priority_class
    row.rate_limit = tenants.stored_limit(spec.rate_limit)
    audit.record(session, who, "key.create", _target(tenant, spec.name), prefix=row.prefix,
                 user=user.name, priority_class=spec.priority_class,
                 rate_limit=row.rate_limit)  # fmt: skip
    return KeyCreated(**_public(row, tenant, user).model_dump(), api_key=secret)


def list_(session: Session, who: Principal, tenant_name: str) -> list[KeyPublic]:
    """The tenant's live keys by name, oldest first (revoked and expired ones are in the
    audit log)."""
    tenant = _managed(session, who, tenant_name)
    return [_public(k, tenant, u) for k, u in _live(session, tenant)]


def revoke(session: Session, who: Principal, tenant_name: str, name: str) -> list[KeyPublic]:
    """Revoke the key `name`, with any key it replaced that is still in its grace period."""
    tenant = _managed(session, who, tenant_name)
    keys = _named(session, tenant, name)
    now = time.time()
    for k, _ in keys:
        k.revoked_at = now
    prefixes = [k.prefix for k, _ in keys]
    audit.record(session, who, "key.revoke", _target(tenant, name), prefixes=prefixes)
    return [_public(k, tenant, u) for k, u in keys]


def rotate(
    session: Session, who: Principal, tenant_name: str, name: str, grace: float
) -> KeyCreated:
    """A new key named `name` for the same user; the keys it replaces stop working after
    `grace` seconds (sooner if they already expire sooner)."""
    tenant = _managed(session, who, tenant_name)
    keys = _named(session, tenant, name)
    end = time.time() + grace
    for k, _ in keys:
        k.expires_at = end if k.expires_at is None else min(k.expires_at, end)
    current, user = keys[-1]
    row, secret = auth.issue_key(session, user, name)
    row.priority_class, row.rate_limit = current.priority_class, current.rate_limit
    audit.record(session, who, "key.rotate", _target(tenant, name), prefix=row.prefix,
                 replaced=current.prefix, grace_seconds=grace)  # fmt: skip
    return KeyCreated(**_public(row, tenant, user).model_dump(), api_key=secret)


def update(
    session: Session, who: Principal, tenant_name: str, name: str, spec: KeyUpdate
) -> list[KeyPublic]:
    """Set the priority class and/or the rate limit of the key `name` (and of a key it
    replaced that is still in its grace period)."""
    tenant = _managed(session, who, tenant_name)
    keys = _named(session, tenant, name)
    changes = spec.model_dump(exclude_unset=True)
    for k, _ in keys:
        if spec.priority_class is not None:
            k.priority_class = spec.priority_class
        if "rate_limit" in changes:
            k.rate_limit = tenants.stored_limit(spec.rate_limit)
    audit.record(session, who, "key.update", _target(tenant, name), **changes)
    return [_public(k, tenant, u) for k, u in keys]


def _managed(session: Session, who: Principal, tenant_name: str) -> Tenant:
    """The tenant whose keys the caller manages: its own as an admin, any as an operator.
    Another tenant's is NotFoundError to a non-operator, as everywhere."""
    tenant = tenants.get(session, who, tenant_name)
    who.require(Role.ADMIN)
    return tenant


def _user(session: Session, who: Principal, tenant: Tenant, name: str | None) -> User:
    """The user a new key acts as: `name`, else the caller, else the tenant's first admin."""
    q = select(User).where(User.tenant_id == tenant.id).order_by(User.id)
    if name is not None:
        user = session.scalar(q.where(User.name == name))
        if user is None:
            users = ", ".join(session.scalars(q.with_only_columns(User.name)))
            raise NotFoundError(f"no user {name!r} in tenant {tenant.name} (users: {users})")
        return user
    if who.tenant_id == tenant.id:
        user = session.get(User, who.user_id)
    else:
        user = session.scalar(q.where(User.role == str(Role.ADMIN)))
    assert user is not None, f"tenant {tenant.name} has no admin"
    return user


def _live(session: Session, tenant: Tenant, name: str | None = None) -> list[tuple[ApiKey, User]]:
    """The tenant's keys that work now (named `name` if given), by name, oldest first."""
    q = (
        select(ApiKey, User)
        .join(User, ApiKey.user_id == User.id)
        .where(User.tenant_id == tenant.id, auth.working(time.time()))
        .order_by(ApiKey.name, ApiKey.id)
    )
    if name is not None:
        q = q.where(ApiKey.name == name)
    return [(k, u) for k, u in session.execute(q)]


def _named(session: Session, tenant: Tenant, name: str) -> list[tuple[ApiKey, User]]:
    keys = _live(session, tenant, name)
    if not keys:
        names = sorted({k.name for k, _ in _live(session, tenant)})
        raise NotFoundError(
            f"no key {name!r} in tenant {tenant.name} (keys: {', '.join(names) or 'none'})"
        )
    return keys


def _target(tenant: Tenant, name: str) -> str:
    return f"tenant/{tenant.name}/key/{name}"


def _public(key: ApiKey, tenant: Tenant, user: User) -> KeyPublic:
    return KeyPublic(
        id=key.id,
        name=key.name,
        prefix=key.prefix,
        tenant=tenant.name,
        user=user.name,
        created_at=key.created_at,
        last_used_at=key.last_used_at,
        expires_at=key.expires_at,
        revoked_at=key.revoked_at,
        priority_class=key.priority_class,
        rate_limit=key.rate_limit,
    )
