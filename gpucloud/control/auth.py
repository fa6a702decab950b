"""API keys and who is calling.

A key is 32 random bytes (url-safe base64) behind a `gpc_` prefix. Only its SHA-256 is
stored: the key has 256 bits of entropy, so a slow password hash would buy nothing.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.control.errors import AuthError, ForbiddenError
from gpucloud.control.lifecycle import Role
from gpucloud.control.models import ApiKey, Tenant, User

_RANK = {Role.VIEWER: 0, Role.MEMBER: 1, Role.ADMIN: 2}


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller behind an API key."""

    tenant_id: int
    tenant_name: str
    user_id: int
    user_name: str
    role: Role
    is_operator: bool  # an admin or member of the operator tenant

    def require(self, role: Role) -> None:
        """Raise ForbiddenError unless the caller's role is at least `role`."""
        if _RANK[self.role] < _RANK[role]:
            raise ForbiddenError(f"role {self.role} may not do this; it needs {role} or higher")

    def require_operator(self) -> None:
        if not self.is_operator or self.role is not Role.ADMIN:
            raise ForbiddenError("only an admin of the operator tenant may do this")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def issue_key(session: Session, user: User) -> str:
    """Create and store a new key for `user`; the plain key is returned once and not kept."""
    key = "gpc_" + secrets.token_urlsafe(32)
    session.add(
        ApiKey(user_id=user.id, prefix=key[:10], key_hash=hash_key(key), created_at=time.time())
    )
    return key


def authenticate(session: Session, key: str | None) -> Principal:
    """The principal owning `key`. Raises AuthError for a missing, unknown or revoked key."""
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
    user, tenant = row.User, row.Tenant
    role = Role(user.role)
    return Principal(tenant.id, tenant.name, user.id, user.name, role, tenant.is_operator)
