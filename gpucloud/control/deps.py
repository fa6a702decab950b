"""FastAPI dependencies: one transaction per request, and the caller behind the API key.

The dependencies that do no blocking I/O are `async def`: FastAPI runs a plain `def`
dependency in a worker thread, and each such hop (a thread handoff and a wake-up of the
event loop) cost about as much as the whole /healthz request. The caller is looked up in a
thread only when its key is not in the app's KeyCache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import BackgroundTasks, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import event
from sqlalchemy.orm import Session

from gpucloud.control.auth import KeyCache, Principal, record_use, use_is_stale
from gpucloud.control.db import Store

_bearer = HTTPBearer(auto_error=False, description="an API key from `gpucloud up` or a tenant")


async def _store(request: Request) -> Store:
    return request.app.state.store


def _session(request: Request) -> Iterator[Session]:
    # Commits when the route function returns, before the response goes out, so a client
    # that reads right after a write sees it. GETs only read: they take no write lock.
    store = request.app.state.store
    begin = store.reading if request.method == "GET" else store.transaction
    with begin() as session:
        yield session


async def _principal(
    request: Request,
    background: BackgroundTasks,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    return await principal(request, background, creds.credentials if creds else None)


async def principal(request: Request, background: BackgroundTasks, key: str | None) -> Principal:
    """The principal owning `key` (from the Authorization header, or the web console's
    session cookie). Raises AuthError for a missing, unknown or revoked key."""
    keys: KeyCache = request.app.state.keys
    who = keys.cached(key) or await run_in_threadpool(keys.lookup, key)
    if use_is_stale(who):  # after the response, when the request's transaction is over
        keys.used(key, who)
        background.add_task(record_use, request.app.state.store, who.key_id)
    return who


def after_commit(session: Session, fn: Callable[[], None]) -> None:
    """Run `fn` once the request's transaction has committed (never if it rolls back)."""
    event.listen(session, "after_commit", lambda _session: fn(), once=True)


async def _wake(request: Request, background: BackgroundTasks) -> None:
    # Runs after the response (so after the commit): the reconciler sees the change at once.
    # Waking is setting an Event: no reason to hop to a worker thread for it.
    wake = request.app.state.wake

    async def wake_reconciler() -> None:
        wake()

    background.add_task(wake_reconciler)


Db = Annotated[Session, Depends(_session, scope="function")]
Caller = Annotated[Principal, Depends(_principal)]
StoreDep = Annotated[Store, Depends(_store)]
Wake = Depends(_wake)
