"""Checking that a server's API docs pages load everything from the server itself."""

from __future__ import annotations

import re

import httpx

# src=, href=, spec-url= attributes and Swagger UI's `url: '...'` setting
_URL = re.compile(r"""(?:\b(?:src|href|spec-url)=|\burl:\s*)["']([^"']+)["']""")
_TYPES = {
    ".js": "javascript",
    ".css": "text/css",
    ".png": "image/png",
    ".json": "application/json",
}


def assert_docs_are_served_locally(base_url: str) -> None:
    """GET /docs and /redoc: HTML whose every script, style, icon and spec URL is on this
    server (no CDN, so the pages work offline) and answers 200 with the right type."""
    with httpx.Client(base_url=base_url, timeout=30) as http:
        for page in ("/docs", "/redoc"):
            r = http.get(page)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            urls = _URL.findall(r.text)
            kinds = {url.rsplit(".", 1)[-1] for url in urls}
            assert {"js", "png", "json"} <= kinds, (page, urls)
            for url in urls:
                assert url.startswith("/") and not url.startswith("//"), (page, url)
                asset = http.get(url)
                assert asset.status_code == 200, (url, asset.status_code)
                want = next(t for ext, t in _TYPES.items() if url.endswith(ext))
                assert want in asset.headers["content-type"], (url, asset.headers)
                assert len(asset.content) > 1000, url  # a real file, not an empty answer
            assert "://" not in r.text.replace(base_url, ""), r.text  # nothing from elsewhere
