"""API keys and who is calling.

A key is 32 random bytes (url-safe base64) behind a `gpc_` prefix. Only its SHA-256 is
stored: the key has 256 bits of entropy, so a slow password hash would buy nothing. A key
is found by its hash through the table's unique index, so no secret is ever compared:
timing tells a caller at most how a hash of its own guess sorts, which says nothing about
any stored key.

`KeyCache` keeps the principals of keys verified recently, so that most requests skip the
lookup (a three-table join in a transaction of its own, and a worker thread to run it in):
see its docstring for how soon a revoked key stops working.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
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
# A key revoked or rotated by another process (another control plane on the same
# PostgreSQL, SQL by hand) stops working within this many seconds; through this process, at
# once (KeyCache).
KEY_CACHE_SECONDS = 5.0


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
    # How the /v1 gateway serves the key (priority.PriorityClass), and the stored limits
    # (ratelimit.Limit fields) of the key and of its tenant.
    priority_class: str = "interactive"
    key_limit: dict | None = None
    tenant_limit: dict | None = None

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
        k.priority_class,
        k.rate_limit,
        tenant.rate_limit,
    )


def use_is_stale(who: Principal) -> bool:
    """Whether the caller's key's last_used_at is older than LAST_USE_RESOLUTION."""
    return who.key_used_at is None or time.time() - who.key_used_at >= LAST_USE_RESOLUTION


def record_use(store: Store, key_id: int) -> None:
    """Set the key's last_used_at to now, in a transaction of its own: call it with no
    transaction open (after a response, or after a read)."""
    with store.transaction() as session:
        session.execute(update(ApiKey).where(ApiKey.id == key_id).values(last_used_at=time.time()))


class KeyCache:
    """The principals of keys verified in the last `ttl` seconds, by key hash.

    How soon a change to a key takes effect:
    - a key revoked or rotated through this control plane: at once. Every transaction of
      `store` whose unit of work changed an ApiKey, User or Tenant object (as the services
      change them) drops the whole cache when it commits. Bulk UPDATE statements are not
      watched: `record_use` writes last_used_at that way without dropping anything;
    - a change made by another process: within `ttl` seconds (KEY_CACHE_SECONDS), when the
      entry expires and the key is looked up again.
    A rotated key's grace period ends on time either way: a cached principal carries its
    end. Failed lookups are not cached: an unknown key costs a lookup each time, as before.
    """

    def __init__(
        self,
        store: Store,
        ttl: float = KEY_CACHE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.ttl = ttl
        self.clock = clock
        self._entries: dict[str, tuple[Principal, float]] = {}  # key hash -> (who, expiry)
        self._lock = threading.Lock()
        # Bumped at each drop, so that a lookup that read the row before a revocation
        # committed does not put the old principal back afterwards.
        self._generation = 0
        store.watch((ApiKey, User, Tenant), self.clear)

    def principal(self, key: str | None) -> Principal:
        """The principal owning `key`, from the cache or the store. Raises AuthError as
        `authenticate` does."""
        return self.cached(key) or self.lookup(key)

    def cached(self, key: str | None) -> Principal | None:
        """The cached principal of `key`, or None if it must be looked up."""
        if not key:
            return None
        hit = self._entries.get(hash_key(key))
        if hit is None or hit[1] <= self.clock():
            return None
        who = hit[0]
        if who.key_expires_at is not None and who.key_expires_at <= time.time():
            return None  # the lookup says why it fails
        return who

    def lookup(self, key: str | None) -> Principal:
        """Authenticate `key` against the store (in a read transaction of its own) and cache
        the principal."""
        generation = self._generation
        with self.store.reading() as session:
            who = authenticate(session, key)
        with self._lock:
            if generation == self._generation:
                self._entries[hash_key(key)] = (who, self.clock() + self.ttl)
        return who

    def used(self, key: str, who: Principal) -> None:
        """Note that `who`'s last_used_at is being written now, so that cached requests do
        not write it again within LAST_USE_RESOLUTION."""
        with self._lock:
            hit = self._entries.get(hash_key(key))
            if hit is not None and hit[0].key_id == who.key_id:
                self._entries[hash_key(key)] = (replace(hit[0], key_used_at=time.time()), hit[1])

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._generation += 1
