"""API keys and who is calling.

A key is 32 random bytes (url-safe base64) behind a `gpc_` prefix. Only its SHA-256 is
stored: the key has 256 bits of entropy, so a slow password hash would buy nothing. A key
is found by its hash through the table's unique index, so no secret is ever compared:
timing tells a caller at most how a hash of its own guess sorts, which says nothing about
any stored key.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import ColumnElement, and_, or_, select, update
from sqlalchemy.orm import Session

from gpucloud.control.errors import AuthError, ForbiddenError
from gpucloud.control.lifecycle import Role
from gpucloud.control.models import ApiKey, Tenant, User

if TYPE_CHECKING:
    from gpucloud.control.db import Store

_RANK = {Role.VIEWER: 0, Role.MEMBER: 1, Role.ADMIN: 2}
# A key's last_used_at is written at most this often (seconds): most requests write nothing.
LAST_USE_RESOLUTION = 60.0


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller behind an API key."""

    tenant_id: int
    tenant_name: str
    user_id: int
    user_name: str
    role: Role
    is_operator: bool  # an admin or member of the operator tenant
    key_id: int
    key_expires_at: float | None  # the end of a rotated key's grace period
    key_used_at: float | None

    def require(self, role: Role) -> None:
        """Raise ForbiddenError unless the caller's role is at least `role`."""
        if _RANK[self.role] < _RANK[role]:
            raise ForbiddenError(f"role {self.role} may not do this; it needs {role} or higher")

    def require_operator(self) -> None:
        if not self.is_operator or self.role is not Role.ADMIN:
            raise ForbiddenError("only an admin of the operator tenant may do this")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def issue_key(session: Session, user: User, name: str) -> tuple[ApiKey, str]:
    """Store a new key named `name` acting as `user`: its row, and the plain key, which is
    returned this once and not kept."""
    key = "gpc_" + secrets.token_urlsafe(32)
    row = ApiKey(
        user_id=user.id, name=name, prefix=key[:10], key_hash=hash_key(key), created_at=time.time()
    )
    session.add(row)
    session.flush()
    return row, key


def working(now: float) -> ColumnElement[bool]:
    """The SQL condition for keys that work at `now`: not revoked, not past a grace period."""
    return and_(
        ApiKey.revoked_at.is_(None), or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > now)
    )


def authenticate(session: Session, key: str | None) -> Principal:
    """The principal owning `key`. Raises AuthError for a missing, unknown or revoked key,
    and for a rotated one whose grace period is over."""
    if not key:
        raise AuthError("missing API key: send 'Authorization: Bearer KEY' (see gpucloud login)")
    row = session.execute(
        select(ApiKey, User, Tenant)
        .join(User, ApiKey.user_id == User.id)
        .join(Tenant, User.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == hash_key(key))
    ).first()
    if row is None or row.ApiKey.revoked_at is not None:
        raise AuthError("invalid or revoked API key")
    k, user, tenant = row.ApiKey, row.User, row.Tenant
    if k.expires_at is not None and k.expires_at <= time.time():
        raise AuthError(f"API key {k.prefix}... was rotated and its grace period is over")
    return Principal(
        tenant.id,
        tenant.name,
        user.id,
        user.name,
        Role(user.role),
        tenant.is_operator,
        k.id,
        k.expires_at,
        k.last_used_at,
    )


def use_is_stale(who: Principal) -> bool:
    """Whether the caller's key's last_used_at is older than LAST_USE_RESOLUTION."""
    return who.key_used_at is None or time.time() - who.key_used_at >= LAST_USE_RESOLUTION


def record_use(store: Store, key_id: int) -> None:
    """Set the key's last_used_at to now, in a transaction of its own: call it with no
    transaction open (after a response, or after a read)."""
    with store.transaction() as session:
        session.execute(update(ApiKey).where(ApiKey.id == key_id).values(last_used_at=time.time()))
