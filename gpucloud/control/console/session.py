"""Who is looking at the console: the API key kept in a session cookie.

The key is sent once, in the body of the login form, and kept in a cookie the page's
scripts cannot read (HttpOnly) and that other sites' pages never send along
(SameSite=Strict), so it is never in a URL, a history entry or a log line. Each request
finds its principal through the app's KeyCache, exactly as the API does: a revoked key
logs the browser out at once.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from fastapi import BackgroundTasks, Depends, Request
from fastapi.responses import Response

from gpucloud.control.auth import Principal
from gpucloud.control.deps import principal
from gpucloud.control.errors import AuthError, ForbiddenError

COOKIE = "gpucloud_session"
LOGIN = "/console/login"


class LoginNeeded(Exception):
    """The request has no working key: the console sends the browser to the login page."""


async def _viewer(request: Request, background: BackgroundTasks) -> Principal:
    if request.method != "GET":
        check_origin(request)
    try:
        return await principal(request, background, request.cookies.get(COOKIE))
    except AuthError as e:
        raise LoginNeeded(str(e)) from e


def check_origin(request: Request) -> None:
    """Refuse a state-changing request sent by another site's page (a second line behind
    SameSite=Strict, for browsers that ignore it). Raises ForbiddenError."""
    origin = request.headers.get("origin")
    # Hosts only: behind a proxy that ends TLS the page's scheme is not the request's.
    if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
        raise ForbiddenError(f"cross-site request from {origin} refused")


def keep(response: Response, request: Request, key: str) -> None:
    """Put `key` in the session cookie of `response` (for the browser's session only)."""
    response.set_cookie(
        COOKIE,
        key,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/console",
    )


def forget(response: Response) -> None:
    response.delete_cookie(COOKIE, path="/console")


Viewer = Annotated[Principal, Depends(_viewer)]
