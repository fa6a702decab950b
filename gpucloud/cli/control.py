"""The control-plane commands, registered on the main app in one call."""

from __future__ import annotations

import typer

from gpucloud.cli import (
    alerts,
    budget,
    deploy,
    job,
    key,
    login,
    node,
    price,
    quota,
    tenant,
    up,
    usage,
)


def register(app: typer.Typer) -> None:
    app.command("up")(up.up)
    app.command("server")(up.server)
    app.command("down")(up.down)
    app.command("login")(login.login)
    app.command("usage")(usage.usage)
    app.add_typer(tenant.app, name="tenant")
    app.add_typer(key.app, name="key")
    app.add_typer(quota.app, name="quota")
    app.add_typer(price.app, name="price")
    app.add_typer(budget.app, name="budget")
    app.add_typer(alerts.app, name="alerts")
    app.add_typer(node.app, name="node")
    app.add_typer(job.app, name="job")
    app.add_typer(deploy.app, name="deploy")
