"""The API's cache of verified keys (auth.KeyCache) on a real store, SQLite and PostgreSQL:
a key revoked through this process's services stops working at once; one revoked by
another process (SQL on a connection of its own) once its entry expires, KEY_CACHE_SECONDS
on the cache's clock; writing last_used_at drops nothing."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, text

from gpucloud.control import db
from gpucloud.control.auth import KEY_CACHE_SECONDS, KeyCache, record_use
from gpucloud.control.errors import AuthError
from gpucloud.control.services import keys, tenants


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(db_url):
    store = db.open_store(db_url)
    yield store
    store.close()


def _admin_key(store: db.Store) -> str:
    with store.transaction() as s:
        return tenants.bootstrap(s)


def test_a_key_revoked_through_the_services_fails_at_once(store):
    key = _admin_key(store)
    cache = KeyCache(store, clock=Clock())
    who = cache.principal(key)
    assert cache.cached(key) == who  # the next request skips the lookup
    with store.transaction() as s:
        keys.revoke(s, who, "operator", "admin")
    assert cache.cached(key) is None
    with pytest.raises(AuthError, match="invalid or revoked"):
        cache.principal(key)


def test_a_key_revoked_by_another_process_fails_once_its_entry_expires(store, db_url):
    key = _admin_key(store)
    clock = Clock()
    cache = KeyCache(store, clock=clock)
    who = cache.principal(key)
    other = create_engine(db.normalize_url(db_url))
    with other.begin() as conn:
        conn.execute(text("UPDATE api_keys SET revoked_at = 1"))
    other.dispose()
    clock.now += KEY_CACHE_SECONDS - 0.1
    assert cache.principal(key) == who  # not seen yet: the stated bound
    clock.now += 0.1
    with pytest.raises(AuthError, match="invalid or revoked"):
        cache.principal(key)


def test_recording_a_keys_use_keeps_it_cached(store):
    key = _admin_key(store)
    cache = KeyCache(store, clock=Clock())
    who = cache.principal(key)
    assert who.key_used_at is None
    cache.used(key, who)
    record_use(store, who.key_id)  # an UPDATE of api_keys, after the response
    cached = cache.cached(key)
    assert cached is not None and cached.key_used_at is not None
