"""FastAPI dependencies: one transaction per request, and the caller behind the API key."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import BackgroundTasks, Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from gpucloud.control.auth import Principal, authenticate
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
    session: Annotated[Session, Depends(_session, scope="function")],
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    return authenticate(session, creds.credentials if creds else None)


def _wake(request: Request, background: BackgroundTasks) -> None:
    # Runs after the response (so after the commit): the reconciler sees the change at once.
    background.add_task(request.app.state.wake)


Db = Annotated[Session, Depends(_session, scope="function")]
Caller = Annotated[Principal, Depends(_principal)]
StoreDep = Annotated[Store, Depends(_store)]
Wake = Depends(_wake)
