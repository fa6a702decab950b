"""`gpucloud key`: a tenant's API keys (create, list, revoke, rotate; tenant admins)."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from gpucloud.cli.login import client
from gpucloud.cli.output import JsonFlag, console, emit, table
from gpucloud.cli.ratelimit import (
    PriorityClassOption,
    RequestsPerMinute,
    TokensPerMinute,
    describe,
    limit,
)
from gpucloud.durations import parse_duration
from gpucloud.errors import UserError

app = typer.Typer(
    help="API keys: several named keys per tenant, revoked or rotated without downtime.",
    no_args_is_help=True,
)
Name = Annotated[str, typer.Argument(help="Key name: letters, digits, . _ -")]
TenantOption = Annotated[
    str | None, typer.Option(help="The tenant (operators: any); default: your own.")
]


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _keys_path(c, tenant: str | None) -> str:
    return f"/tenants/{tenant or c.get('/me')['tenant']}/keys"


def _print_secret(k: dict, done: str) -> None:
    console.print(
        f"key {k['name']} of tenant {k['tenant']} {done} (acts as {k['user']}); "
        f"API key (shown once): {k['api_key']}",
        highlight=False,
        soft_wrap=True,
    )


@app.command("create")
def create(
    name: Name,
    tenant: TenantOption = None,
    user: Annotated[
        str | None, typer.Option(help="The user the key acts as; default: you.")
    ] = None,
    priority_class: PriorityClassOption = "interactive",
    requests_per_minute: RequestsPerMinute = None,
    tokens_per_minute: TokensPerMinute = None,
    as_json: JsonFlag = False,
) -> None:
    """Create a key; prints its secret once (`api_key` in --json)."""
    c = client()
    body = {"name": name, "user": user, "priority_class": priority_class,
            "rate_limit": limit(requests_per_minute, tokens_per_minute)}  # fmt: skip
    k = c.post(_keys_path(c, tenant), body)
    emit(k, as_json, lambda k: _print_secret(k, "created"))


@app.command("list")
def list_(tenant: TenantOption = None, as_json: JsonFlag = False) -> None:
    """The tenant's working keys: name and prefix, never the secret."""
    c = client()
    rows = c.get(_keys_path(c, tenant))
    emit(
        rows,
        as_json,
        lambda rows: console.print(
            table(
                "API keys",
                [
                    "name",
                    "prefix",
                    "user",
                    "class",
                    "rate limit",
                    "created",
                    "last used",
                    "expires",
                ],  # fmt: skip
                [
                    (
                        k["name"],
                        k["prefix"] + "...",
                        k["user"],
                        k["priority_class"],
                        describe(k["rate_limit"]),
                        _when(k["created_at"]),
                        _when(k["last_used_at"]),
                        _when(k["expires_at"]),
                    )  # fmt: skip
                    for k in rows
                ],
            )
        ),
    )


@app.command("limit")
def limit_(
    name: Name,
    tenant: TenantOption = None,
    priority_class: PriorityClassOption = None,
    requests_per_minute: RequestsPerMinute = None,
    tokens_per_minute: TokensPerMinute = None,
    unlimited: Annotated[bool, typer.Option(help="Lift the key's rate limit.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Change a key's priority class, or replace its rate limit (both per-minute figures at
    once: one left out is unlimited), at once for every request."""
    body: dict = {}
    if priority_class is not None:
        body["priority_class"] = priority_class
    if unlimited or requests_per_minute or tokens_per_minute:
        body["rate_limit"] = {} if unlimited else limit(requests_per_minute, tokens_per_minute)
    if not body:
        raise UserError(
            "nothing to change: give --priority-class, a per-minute limit or --unlimited"
        )
    c = client()
    rows = c.patch(f"{_keys_path(c, tenant)}/{name}", body)
    emit(
        rows,
        as_json,
        lambda rows: console.print(
            f"key {name}: {rows[-1]['priority_class']}, {describe(rows[-1]['rate_limit'])}",
            highlight=False,
        ),
    )


@app.command("revoke")
def revoke(name: Name, tenant: TenantOption = None, as_json: JsonFlag = False) -> None:
    """Revoke a key (and the key it replaced, if still in its grace period), at once."""
    c = client()
    rows = c.delete(f"{_keys_path(c, tenant)}/{name}")
    emit(
        rows,
        as_json,
        lambda rows: console.print(
            f"key {name} revoked: " + ", ".join(k["prefix"] + "..." for k in rows),
            highlight=False,
        ),
    )


@app.command("rotate")
def rotate(
    name: Name,
    tenant: TenantOption = None,
    grace: Annotated[
        str, typer.Option(help="How long the old key keeps working: 30s, 15m, 24h, 7d.")
    ] = "24h",
    as_json: JsonFlag = False,
) -> None:
    """A new key under the same name, its secret printed once; the old one works --grace more."""
    seconds = parse_duration(grace)
    if seconds is None:
        raise UserError(f"--grace {grace!r}: use a duration like 30s, 15m, 24h or 7d (0s: none)")
    c = client()
    k = c.post(f"{_keys_path(c, tenant)}/{name}/rotate", {"grace_seconds": seconds})
    emit(k, as_json, lambda k: _print_secret(k, f"rotated, the old key works {grace} more"))
