"""Who is looking at the console: a server-side session, named by an opaque id in a
cookie.

The API key is sent once, in the body of the login form; the browser then holds only a
random session id (sessions.py), in a cookie the page's scripts cannot read (HttpOnly)
and that other sites' pages never send along (SameSite=Strict): the key is never in a
cookie, a URL, a page, a history entry or a log line. Each request finds its principal
through the session's key and the app's KeyCache, exactly as the API does: a key revoked
or rotated ends its sessions at once.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from fastapi import BackgroundTasks, Depends, Request
from fastapi.responses import Response

from gpucloud.control.auth import Principal
from gpucloud.control.console.sessions import Sessions
from gpucloud.control.deps import principal
from gpucloud.control.errors import AuthError, ForbiddenError

COOKIE = "gpucloud_session"
LOGIN = "/console/login"


class LoginNeeded(Exception):
    """The request has no working session: the console sends the browser to the login page."""


def sessions(request: Request) -> Sessions:
    return request.app.state.console_sessions


async def _viewer(request: Request, background: BackgroundTasks) -> Principal:
    if request.method != "GET":
        check_origin(request)
    key = sessions(request).key(request.cookies.get(COOKIE))
    if key is None:
        raise LoginNeeded("no session: log in")
    try:
        return await signed_in(request, background, key)
    except AuthError as e:
        sessions(request).end_key(key)
        raise LoginNeeded(str(e)) from e


async def signed_in(request: Request, background: BackgroundTasks, key: str) -> Principal:
    """The principal of `key`, which may hold a console session. Raises AuthError for a
    key that does not work, and for a rotated one (its replacement must log in)."""
    who = await principal(request, background, key)
    if who.key_expires_at is not None:
        raise AuthError("this API key was rotated: log in with the key that replaced it")
    return who


def check_origin(request: Request) -> None:
    """Refuse a state-changing request sent by another site's page (a second line behind
    SameSite=Strict, for browsers that ignore it). Raises ForbiddenError."""
    origin = request.headers.get("origin")
    # Hosts only: behind a proxy that ends TLS the page's scheme is not the request's.
    if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
        raise ForbiddenError(f"cross-site request from {origin} refused")


def keep(response: Response, request: Request, key: str) -> None:
    """Open a session acting with `key` and put its id in `response`'s cookie (for the
    browser's session only)."""
    response.set_cookie(
        COOKIE,
        sessions(request).open(key),
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/console",
    )


def end(response: Response, request: Request) -> None:
    """End the request's session, and have the browser drop its cookie."""
    sessions(request).close(request.cookies.get(COOKIE))
    forget(response)


def forget(response: Response) -> None:
    response.delete_cookie(COOKIE, path="/console")


Viewer = Annotated[Principal, Depends(_viewer)]
