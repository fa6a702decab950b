"""Pages and fragments from the package's Jinja2 templates.

Each page `NAME.html` shows its changing part from `NAME_live.html`; the page polls its own
URL with htmx (header `HX-Target: live`), and gets that part alone.
"""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import parse_qsl

from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from gpucloud.control.auth import Principal
from gpucloud.errors import TooLargeError

HERE = Path(__file__).parent
PREFIX = "/console"
MAX_FORM_BYTES = 64 * 1024

templates = Jinja2Templates(directory=HERE / "templates")


def _ago(at: float | None) -> str:
    """'12 s ago', '3 min ago', '5 h ago' (human time at the edge only)."""
    if at is None:
        return "—"
    seconds = max(time.time() - at, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def _eta(at: float) -> str:
    """'now', 'in ~12 min', 'in ~3 h': an estimated start."""
    return "now" if at - time.time() < 60 else f"in {_from_now(at)}"


def _from_now(at: float) -> str:
    """'~12 min', '~3 h', '~2 d' from now (at least a minute)."""
    seconds = max(at - time.time(), 60.0)
    unit, size = next(u for u in (("d", 86400), ("h", 3600), ("min", 60)) if seconds >= u[1])
    return f"~{seconds / size:.0f} {unit}"


def _clock(at: float | None) -> str:
    return "—" if at is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


templates.env.filters["ago"] = _ago
templates.env.filters["clock"] = _clock
templates.env.filters["eta"] = _eta
templates.env.filters["from_now"] = _from_now
templates.env.globals["prefix"] = PREFIX


def page(request: Request, name: str, who: Principal | None, status: int = 200, **context):
    """Page `name`, or only its live part when htmx polls for it."""
    live = request.headers.get("hx-target") == "live"
    template = f"{name}_live.html" if live else f"{name}.html"
    context = {"who": who, "page": name, **context}
    return templates.TemplateResponse(request, template, context, status_code=status)


def fragment(request: Request, template: str, status: int = 200, **context) -> HTMLResponse:
    return templates.TemplateResponse(request, template, context, status_code=status)


def alert(request: Request, message: str, status: int) -> HTMLResponse:
    """A one-line error, shown in the page's alert region whatever the form's target."""
    response = fragment(request, "alert.html", status, message=message)
    response.headers.update({"HX-Retarget": "#alerts", "HX-Reswap": "innerHTML"})
    return response


async def body(request: Request, limit: int) -> bytes:
    """The request's body. Raises TooLargeError past `limit` bytes."""
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise TooLargeError(f"request body too large: the limit here is {limit} bytes")
    return bytes(data)


async def form(request: Request) -> dict[str, str]:
    """The fields of an urlencoded form body (the last value of a repeated field)."""
    raw = await body(request, MAX_FORM_BYTES)
    return dict(parse_qsl(raw.decode(errors="replace")))
