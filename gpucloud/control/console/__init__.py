"""The web console under /console: server-rendered pages (Jinja2) made live with htmx,
charts drawn by uPlot; every asset is served from the package (static/vendor/README.md).

`mount(app)` adds it to the control plane's app; `/` leads to it. Its forms post
urlencoded bodies, not JSON: each route reads its body itself, within its own limit.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from gpucloud.control.console import actions, pages
from gpucloud.control.console.render import HERE, PREFIX
from gpucloud.control.console.serving import Sampler
from gpucloud.control.console.session import LOGIN, LoginNeeded, forget
from gpucloud.control.console.sessions import Sessions

__all__ = ["PREFIX", "mount"]


def mount(app: FastAPI) -> None:
    app.state.console_sessions = Sessions()
    app.state.console_serving = Sampler(app.state.metrics)
    app.include_router(actions.router)
    app.include_router(pages.router)
    app.mount(f"{PREFIX}/static", StaticFiles(directory=HERE / "static"), name="console-static")

    @app.get("/", include_in_schema=False)
    def _home() -> RedirectResponse:
        return RedirectResponse(f"{PREFIX}/", status_code=303)

    @app.exception_handler(LoginNeeded)
    async def _login_needed(request: Request, _error: LoginNeeded) -> Response:
        # htmx follows HX-Redirect (a poll whose key was revoked); a page load a 303.
        if request.headers.get("hx-request"):
            response: Response = Response(headers={"HX-Redirect": LOGIN})
        else:
            response = RedirectResponse(LOGIN, status_code=303)
        forget(response)
        return response
