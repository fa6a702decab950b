"""`gpucloud tenant`: create and list tenants, their rate limits and cohorts (operators
change them)."""

from __future__ import annotations

from typing import Annotated

import typer

from gpucloud.cli.login import client
from gpucloud.cli.output import JsonFlag, console, emit, table
from gpucloud.cli.ratelimit import RequestsPerMinute, TokensPerMinute, describe, limit
from gpucloud.errors import UserError

app = typer.Typer(help="Tenants: teams sharing the cluster.", no_args_is_help=True)


def _quotas(t: dict) -> str:
    return ", ".join(f"{q['gpus']} x {q['gpu_type']}" for q in t["quotas"]) or "unlimited"


@app.command("create")
def create(
    name: Annotated[str, typer.Argument(help="Tenant name: letters, digits, . _ -")],
    weight: Annotated[float, typer.Option(help="Fair-share weight.")] = 1.0,
    network: Annotated[
        str,
        typer.Option(
            help="host: its jobs share the node's network; isolated: each job gets its own "
            "network namespace, loopback only (replicas keep the host's for the gateway).",
        ),
    ] = "host",
    as_json: JsonFlag = False,
) -> None:
    """Create a tenant; prints its first admin API key once (`api_key` in --json)."""
    t = client().post("/tenants", {"name": name, "weight": weight, "network": network})
    emit(
        t,
        as_json,
        lambda t: console.print(
            f"tenant {t['name']} created; admin API key (shown once): {t['api_key']}",
            highlight=False,
            soft_wrap=True,
        ),
    )


@app.command("list")
def list_(as_json: JsonFlag = False) -> None:
    """Tenants with their quotas (all of them for an operator)."""
    rows = client().get("/tenants")
    emit(
        rows,
        as_json,
        lambda rows: console.print(
            table(
                "Tenants",
                ["name", "operator", "weight", "quotas", "cohort", "rate limit"],
                [
                    (
                        t["name"],
                        "yes" if t["is_operator"] else "",
                        f"{t['weight']:g}",
                        _quotas(t),
                        t["cohort"] or "",
                        describe(t["rate_limit"]),
                    )  # fmt: skip
                    for t in rows
                ],
            )
        ),
    )


@app.command("rate-limit")
def rate_limit(
    name: Annotated[str, typer.Argument(help="Tenant name.")],
    requests_per_minute: RequestsPerMinute = None,
    tokens_per_minute: TokensPerMinute = None,
    as_json: JsonFlag = False,
) -> None:
    """Limit what all of a tenant's keys together send through /v1 (operators; no figure
    lifts the limit). Over it, requests are answered 429 with Retry-After."""
    t = client().put(f"/tenants/{name}/rate-limit", limit(requests_per_minute, tokens_per_minute))
    emit(
        t,
        as_json,
        lambda t: console.print(
            f"tenant {t['name']}: {describe(t['rate_limit'])}", highlight=False
        ),
    )


@app.command("idle-ttl")
def idle_ttl(
    name: Annotated[str, typer.Argument(help="Tenant name.")],
    ttl: Annotated[
        str,
        typer.Argument(help="e.g. 30m or 2h; 0 or never: not reclaimed; default: the cluster's."),
    ],
    as_json: JsonFlag = False,
) -> None:
    """How long the tenant's deployments (without a request) and interactive jobs (with
    their accelerators idle) may sit before they are reclaimed, unless they set their own
    (operators). A deployment is then scaled to zero, an interactive job stopped."""
    body = {"idle_ttl": None if ttl == "default" else ttl}
    t = client().put(f"/tenants/{name}/idle-ttl", body)
    emit(t, as_json, lambda t: console.print(_idle_text(t), highlight=False))


def _idle_text(t: dict) -> str:
    from gpucloud.durations import format_duration

    ttl = t["idle_ttl"]
    if ttl is None:
        return f"tenant {t['name']}: idle workloads reclaimed after the cluster's idle TTL"
    if ttl == 0:
        return f"tenant {t['name']}: idle workloads are not reclaimed"
    return f"tenant {t['name']}: idle workloads reclaimed after {format_duration(ttl)}"


@app.command("cohort")
def cohort(
    name: Annotated[str, typer.Argument(help="Tenant name.")],
    cohort: Annotated[
        str | None, typer.Argument(help="Cohort name: letters, digits, . _ -", show_default=False)
    ] = None,
    none: Annotated[bool, typer.Option("--none", help="Take it out of its cohort.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Put a tenant in a cohort (operators): tenants of one cohort run preemptible jobs on
    each other's idle quota, and a lender takes its quota back by preempting them."""
    if (cohort is None) == (not none):
        raise UserError("give a COHORT name or --none (to leave its cohort), one of the two")
    t = client().put(f"/tenants/{name}/cohort", {"cohort": cohort})
    emit(
        t,
        as_json,
        lambda t: console.print(
            f"tenant {t['name']}: "
            + (f"in cohort {t['cohort']}" if t["cohort"] else "in no cohort"),
            highlight=False,
        ),
    )
