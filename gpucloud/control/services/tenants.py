"""Tenants, their users and API keys, and quotas."""

from __future__ import annotations

import time

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpucloud import hardware
from gpucloud.control import auth
from gpucloud.control.auth import Principal
from gpucloud.control.errors import ConflictError
from gpucloud.control.lifecycle import Role
from gpucloud.control.models import ApiKey, Quota, Tenant, User
from gpucloud.control.schemas import (
    QuotaPublic,
    RateLimit,
    TenantCreate,
    TenantCreated,
    TenantPublic,
    UserCreate,
    UserCreated,
)
from gpucloud.control.services import audit
from gpucloud.errors import NotFoundError

OPERATOR_TENANT = "operator"


def bootstrap(session: Session) -> str | None:
    """Create the operator tenant and its admin on an empty store.

    Returns the admin's API key, or None when the store was already bootstrapped.
    """
    if session.scalar(select(func.count()).select_from(Tenant)):
        return None
    tenant = Tenant(name=OPERATOR_TENANT, is_operator=True, weight=1.0, created_at=time.time())
    session.add(tenant)
    session.flush()
    _, key = auth.issue_key(session, _add_user(session, tenant, "admin", Role.ADMIN), "admin")
    audit.record(session, None, "bootstrap", f"tenant/{tenant.name}")
    return key


def create(session: Session, who: Principal, spec: TenantCreate) -> TenantCreated:
    """A new tenant with an admin user; its first API key is in the answer (only there)."""
    who.require_operator()
    if session.scalar(select(Tenant.id).where(Tenant.name == spec.name)):
        raise ConflictError(f"tenant {spec.name!r} already exists")
    tenant = Tenant(
        name=spec.name,
        is_operator=False,
        weight=spec.weight,
        network=spec.network,
        created_at=time.time(),
    )
    session.add(tenant)
    session.flush()
    _, key = auth.issue_key(session, _add_user(session, tenant, "admin", Role.ADMIN), "admin")
    audit.record(
        session, who, "tenant.create", f"tenant/{tenant.name}", weight=spec.weight,
        network=spec.network,
    )  # fmt: skip
    return TenantCreated(**public(session, tenant).model_dump(), api_key=key)


def list_(session: Session, who: Principal) -> list[TenantPublic]:
    """Every tenant for an operator; the caller's own tenant otherwise."""
    q = select(Tenant).order_by(Tenant.id)
    if not who.is_operator:
        q = q.where(Tenant.id == who.tenant_id)
    return [public(session, t) for t in session.scalars(q)]


def get(session: Session, who: Principal, name: str) -> Tenant:
    """The tenant called `name`, if the caller may see it (else NotFoundError)."""
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None or (not who.is_operator and tenant.id != who.tenant_id):
        raise NotFoundError(f"no tenant {name!r}")
    return tenant


def set_quota(
    session: Session, who: Principal, name: str, gpu_type: str, gpus: int
) -> TenantPublic:
    """Cap `name`'s GPUs of `gpu_type` in use at once at `gpus` (operators only)."""
    who.require_operator()
    tenant = get(session, who, name)
    gpu_type = hardware.get(gpu_type).name
    quota = session.scalar(
        select(Quota).where(Quota.tenant_id == tenant.id, Quota.gpu_type == gpu_type)
    )
    if quota is None:
        session.add(Quota(tenant_id=tenant.id, gpu_type=gpu_type, gpus=gpus))
    else:
        quota.gpus = gpus
    audit.record(session, who, "quota.set", f"tenant/{name}", gpu_type=gpu_type, gpus=gpus)
    session.flush()
    return public(session, tenant)


def set_rate_limit(session: Session, who: Principal, name: str, limit: RateLimit) -> TenantPublic:
    """Limit `name`'s requests and tokens per minute through the /v1 gateway, over all of
    its keys (operators only; an empty limit lifts them)."""
    who.require_operator()
    tenant = get(session, who, name)
    tenant.rate_limit = stored_limit(limit)
    audit.record(session, who, "tenant.rate_limit", f"tenant/{name}", **limit.model_dump())
    session.flush()
    return public(session, tenant)


def set_cohort(session: Session, who: Principal, name: str, cohort: str | None) -> TenantPublic:
    """Put `name` in `cohort` (None: in none): it may then run preemptible jobs on the
    cohort's idle quota, and the others take theirs back (operators only)."""
    who.require_operator()
    tenant = get(session, who, name)
    tenant.cohort = cohort
    audit.record(session, who, "tenant.cohort", f"tenant/{name}", cohort=cohort)
    session.flush()
    return public(session, tenant)


def set_idle_ttl(session: Session, who: Principal, name: str, ttl: float | None) -> TenantPublic:
    """Set how long `name`'s deployments and interactive jobs that set no idle TTL of their
    own may sit idle before they are reclaimed (operators only; None: the cluster's)."""
    who.require_operator()
    tenant = get(session, who, name)
    tenant.idle_ttl = ttl
    audit.record(session, who, "tenant.idle_ttl", f"tenant/{name}", idle_ttl=ttl)
    session.flush()
    return public(session, tenant)


def stored_limit(limit: RateLimit | None) -> dict | None:
    """The column value of `limit`: None when it limits nothing."""
    fields = limit.model_dump(exclude_none=True) if limit else {}
    return fields or None


def create_user(session: Session, who: Principal, spec: UserCreate) -> UserCreated:
    """A user in the caller's tenant with a new key named after it (tenant admins only)."""
    who.require(Role.ADMIN)
    tenant = session.get(Tenant, who.tenant_id)
    assert tenant is not None
    if session.scalar(select(User.id).where(User.tenant_id == tenant.id, User.name == spec.name)):
        raise ConflictError(f"user {spec.name!r} already exists in tenant {tenant.name!r}")
    if session.scalar(
        select(ApiKey.id)
        .join(User, ApiKey.user_id == User.id)
        .where(User.tenant_id == tenant.id, ApiKey.name == spec.name, auth.working(time.time()))
    ):
        raise ConflictError(
            f"tenant {tenant.name!r} has a key named {spec.name!r}, the name of the new "
            "user's key: revoke that key or choose another user name"
        )
    user = _add_user(session, tenant, spec.name, spec.role)
    _, key = auth.issue_key(session, user, spec.name)
    audit.record(session, who, "user.create", f"user/{spec.name}", role=str(spec.role))
    return UserCreated(id=user.id, tenant=tenant.name, name=user.name, role=user.role, api_key=key)


def quotas(session: Session, tenant_id: int) -> dict[str, int]:
    rows = session.execute(select(Quota.gpu_type, Quota.gpus).where(Quota.tenant_id == tenant_id))
    return dict(rows.all())


def public(session: Session, tenant: Tenant) -> TenantPublic:
    return TenantPublic(
        id=tenant.id,
        name=tenant.name,
        is_operator=tenant.is_operator,
        weight=tenant.weight,
        network=tenant.network,
        created_at=tenant.created_at,
        quotas=[
            QuotaPublic(gpu_type=t, gpus=g) for t, g in sorted(quotas(session, tenant.id).items())
        ],
        rate_limit=tenant.rate_limit,
        cohort=tenant.cohort,
        idle_ttl=tenant.idle_ttl,
    )


def _add_user(session: Session, tenant: Tenant, name: str, role: Role) -> User:
    user = User(tenant_id=tenant.id, name=name, role=str(role), created_at=time.time())
    session.add(user)
    session.flush()
    return user
