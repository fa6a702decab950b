"""Fixtures for the web console: the control-plane servers of tests/control, and a
logged-in HTTP session of a tenant."""

from __future__ import annotations

import httpx
from control.conftest import (  # noqa: F401 (fixtures, found by pytest by name)
    Server,
    postgres,
    postgresql_server,
    shared_server,
    sqlite_server,
)


def login(server: Server, key: str) -> httpx.Client:
    """An HTTP client holding the console's session cookie of `key`."""
    http = httpx.Client(base_url=server.url, timeout=10)
    response = http.post("/console/login", data={"key": key})
    assert response.status_code == 303, response.text
    assert "gpucloud_session" in http.cookies
    return http
