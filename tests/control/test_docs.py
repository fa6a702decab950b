"""The control plane's API docs work offline: no asset comes from a CDN."""

from __future__ import annotations

from docs_page import assert_docs_are_served_locally


def test_docs_pages_load_every_asset_from_the_server(sqlite_server):
    assert_docs_are_served_locally(sqlite_server.url)
