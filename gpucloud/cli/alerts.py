"""`gpucloud alerts`: the Prometheus rules and Grafana dashboards shipped in the package."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from gpucloud.cli.output import console

app = typer.Typer(
    help="Prometheus alert rules and Grafana dashboards for this control plane.",
    no_args_is_help=True,
)


@app.command("rules")
def rules() -> None:
    """Print the alert rules (budget burn, queue wait, GPUs idle while jobs wait, replica
    restarts and errors, nodes down, TTFT p99) as a Prometheus rule file."""
    from gpucloud.control import alerts

    sys.stdout.write(alerts.rules_text())


@app.command("dashboards")
def dashboards(
    out: Annotated[Path, typer.Option(help="Directory to write the dashboards' JSON into.")],
) -> None:
    """Write the Grafana dashboards (cluster and queue; cost, budgets and serving) to OUT."""
    from gpucloud.control import alerts

    out.mkdir(parents=True, exist_ok=True)
    for name, text in alerts.dashboards().items():
        (out / name).write_text(text)
        console.print(f"wrote {out / name}", highlight=False)
