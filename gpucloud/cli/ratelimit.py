"""The options that set a /v1 rate limit (a tenant's or a key's), shared by their commands."""

from __future__ import annotations

from typing import Annotated

import typer

RequestsPerMinute = Annotated[
    int | None, typer.Option(min=1, help="Requests per minute through /v1 (unset: any).")
]
TokensPerMinute = Annotated[
    int | None,
    typer.Option(min=1, help="Prompt + completion tokens per minute through /v1 (unset: any)."),
]
PriorityClassOption = Annotated[
    str | None,
    typer.Option(
        help="interactive | batch: a batch key's /v1 requests wait while interactive ones "
        "are served."
    ),
]


def limit(requests_per_minute: int | None, tokens_per_minute: int | None) -> dict:
    """The body of a rate limit: {} lifts it."""
    body = {"requests_per_minute": requests_per_minute, "tokens_per_minute": tokens_per_minute}
    return {k: v for k, v in body.items() if v is not None}


def describe(stored: dict | None) -> str:
    """A rate limit for tables: '60 req/min, 10000 tok/min', or 'unlimited'."""
    parts = []
    if stored and stored.get("requests_per_minute"):
        parts.append(f"{stored['requests_per_minute']} req/min")
    if stored and stored.get("tokens_per_minute"):
        parts.append(f"{stored['tokens_per_minute']} tok/min")
    return ", ".join(parts) or "unlimited"
