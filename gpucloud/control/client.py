"""The control plane's HTTP client (httpx), used by the CLI and by tests.

Errors come back as gpucloud exceptions carrying the server's one-line message.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from gpucloud.control.errors import AuthError, ConflictError, ForbiddenError
from gpucloud.errors import CapacityError, ConfigError, GpucloudError, NotFoundError, UserError

_ERRORS: dict[int, type[GpucloudError]] = {
    401: AuthError,
    403: ForbiddenError,
    404: NotFoundError,
    409: ConflictError,
}
# The server names its error class; these are re-raised as the same class here.
_BY_NAME = {c.__name__: c for c in (*_ERRORS.values(), CapacityError, ConfigError, UserError)}


class Client:
    def __init__(self, url: str, api_key: str | None, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url + "/api/v1", headers=headers, timeout=timeout)

    def get(self, path: str, **params: Any) -> Any:
        return self._call("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: Any = None) -> Any:
        return self._call("POST", path, json=body)

    def put(self, path: str, body: Any) -> Any:
        return self._call("PUT", path, json=body)

    def patch(self, path: str, body: Any) -> Any:
        return self._call("PATCH", path, json=body)

    def delete(self, path: str) -> Any:
        return self._call("DELETE", path)

    def upload(self, archive: Path) -> Any:
        """Send a gzipped tar to POST /uploads; the unpacked dir's path, files and bytes."""
        with archive.open("rb") as body:
            headers = {"Content-Type": "application/octet-stream"}  # a gzipped tar
            return self._call("POST", "/uploads", content=body, headers=headers, timeout=None)

    def stream(self, path: str, **params: Any) -> Iterator[str]:
        """Yield a streamed text response's chunks as they arrive."""
        try:
            with self._http.stream("GET", path, params=params, timeout=None) as r:
                if r.status_code >= 400:
                    r.read()
                    _raise(r)
                yield from r.iter_text()
        except httpx.TransportError as e:
            raise self._unreachable(e) from None

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise self._unreachable(e) from None
        if r.status_code >= 400:
            _raise(r)
        return (
            r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text
        )

    def _unreachable(self, e: Exception) -> UserError:
        return UserError(
            f"cannot reach the control plane at {self.url} ({e}); start one with `gpucloud up`"
        )


def _raise(r: httpx.Response) -> None:
    try:
        body = r.json()
        detail, name = body.get("detail", r.text), body.get("error")
    except (ValueError, AttributeError):
        detail, name = r.text, None
    if isinstance(detail, list):  # a validation error: name each field that is wrong
        detail = "; ".join(
            f"{'.'.join(str(p) for p in d.get('loc', [])[1:])}: {d.get('msg')}" for d in detail
        )
    cls = _BY_NAME.get(name or "") or _ERRORS.get(
        r.status_code, UserError if r.status_code < 500 else GpucloudError
    )
    raise cls(str(detail))
