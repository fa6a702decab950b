"""FastAPI dependencies: one transaction per request, and the caller behind the API key."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import BackgroundTasks, Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import event
from sqlalchemy.orm import Session

from gpucloud.control.auth import Principal, authenticate, record_use, use_is_stale
from gpucloud.control.db import Store

_bearer = HTTPBearer(auto_error=False, description="an API key from `gpucloud up` or a tenant")


def _store(request: Request) -> Store:
    return request.app.state.store


def _session(request: Request) -> Iterator[Session]:
    # Commits when the route function returns, before the response goes out, so a client
    # that reads right after a write sees it. GETs only read: they take no write lock.
    store = _store(request)
    begin = store.reading if request.method == "GET" else store.transaction
    with begin() as session:
        yield session


def _principal(
    request: Request,
    background: BackgroundTasks,
    session: Annotated[Session, Depends(_session, scope="function")],
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    who = authenticate(session, creds.credentials if creds else None)
    if use_is_stale(who):  # after the response, when the request's transaction is over
        background.add_task(record_use, _store(request), who.key_id)
    return who


def after_commit(session: Session, fn: Callable[[], None]) -> None:
    """Run `fn` once the request's transaction has committed (never if it rolls back)."""
    event.listen(session, "after_commit", lambda _session: fn(), once=True)


def _wake(request: Request, background: BackgroundTasks) -> None:
    # Runs after the response (so after the commit): the reconciler sees the change at once.
    background.add_task(request.app.state.wake)


Db = Annotated[Session, Depends(_session, scope="function")]
Caller = Annotated[Principal, Depends(_principal)]
StoreDep = Annotated[Store, Depends(_store)]
Wake = Depends(_wake)
