"""The audit log: who did what to which object."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from gpucloud.control.auth import Principal
from gpucloud.control.models import AuditEntry, Tenant, User
from gpucloud.control.schemas import AuditPublic


def record(
    session: Session,
    who: Principal | None,
    action: str,
    target: str,
    tenant_id: int | None = None,
    **detail: Any,
) -> None:
    """Add one entry; it commits with the change it describes. Without `who` (the control
    plane acted by itself), `tenant_id` says whose object it was."""
    session.add(AuditEntry(**entry(who, action, target, tenant_id, **detail)))


def entry(
    who: Principal | None,
    action: str,
    target: str,
    tenant_id: int | None = None,
    **detail: Any,
) -> dict[str, Any]:
    """The columns of one entry, for `record_all`."""
    return {
        "at": time.time(),
        "tenant_id": who.tenant_id if who else tenant_id,
        "user_id": who.user_id if who else None,
        "action": action,
        "target": target,
        "detail": detail,
    }


def record_all(session: Session, entries: list[dict[str, Any]]) -> None:
    """Add several entries (made by `entry`) in one statement, which reads nothing back
    (not even the new ids: it may be in a `db.unread` block)."""
    session.connection().execute(insert(AuditEntry.__table__).inline(), entries)


def entries(session: Session, who: Principal, limit: int = 100) -> list[AuditPublic]:
    """The newest entries: of the caller's tenant, or of everyone for an operator."""
    q = (
        select(AuditEntry, Tenant.name, User.name)
        .outerjoin(Tenant, AuditEntry.tenant_id == Tenant.id)
        .outerjoin(User, AuditEntry.user_id == User.id)
        .order_by(AuditEntry.id.desc())
        .limit(limit)
    )
    if not who.is_operator:
        q = q.where(AuditEntry.tenant_id == who.tenant_id)
    return [
        AuditPublic(at=e.at, tenant=t, user=u, action=e.action, target=e.target, detail=e.detail)
        for e, t, u in session.execute(q)
    ]
