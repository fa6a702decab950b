"""`gpucloud budget`: monthly GPU-hour or money budgets per tenant, user or job label."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlencode

import typer

from gpucloud.cli.login import client
from gpucloud.cli.output import JsonFlag, console, emit, table
from gpucloud.cli.price import when

app = typer.Typer(
    help="Budgets per calendar month: warn past a soft threshold, hold new work when spent.",
    no_args_is_help=True,
)
UNITS = {"gpu_hours": "GPU-h", "usd": "USD"}


@app.command("set")
def set_(
    tenant: Annotated[str, typer.Argument(help="Tenant name.")],
    amount: Annotated[float, typer.Argument(min=0, help="Allowance per calendar month (UTC).")],
    unit: Annotated[str, typer.Option(help="gpu_hours or usd.")] = "gpu_hours",
    user: Annotated[str, typer.Option(help="Only this user's work.")] = "",
    label: Annotated[str, typer.Option(help="Only jobs with this label, key=value.")] = "",
    soft: Annotated[float, typer.Option(help="Warn from this fraction of AMOUNT on.")] = 0.8,
    on_exhausted: Annotated[
        str, typer.Option(help="queue: new work waits; stop: running jobs are stopped too.")
    ] = "queue",
    as_json: JsonFlag = False,
) -> None:
    """Set TENANT's monthly budget (operators only)."""
    body = {"user": user, "label": label, "unit": unit, "amount": amount, "soft": soft,
            "on_exhausted": on_exhausted}  # fmt: skip
    emit(client().put(f"/tenants/{tenant}/budgets", body), as_json, lambda b: _render([b]))


@app.command("delete")
def delete(
    tenant: Annotated[str, typer.Argument(help="Tenant name.")],
    user: Annotated[str, typer.Option(help="The user's budget.")] = "",
    label: Annotated[str, typer.Option(help="The label's budget, key=value.")] = "",
) -> None:
    """Remove a budget (operators only)."""
    client().delete(f"/tenants/{tenant}/budgets?" + urlencode({"user": user, "label": label}))
    console.print(f"budget of {tenant} removed", highlight=False)


@app.command("list")
def list_(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant (operators).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """This month's budgets: spent, state, burn rate, and when each runs out at that rate."""
    emit(client().get("/budgets", tenant=tenant), as_json, _render)


def _render(budgets: list[dict]) -> None:
    console.print(
        table(
            "Budgets this month",
            ["tenant", "user", "label", "spent", "of", "state", "burn /h", "runs out", "then"],
            [
                (
                    b["tenant"],
                    b["user"] or "all",
                    b["label"] or "all",
                    f"{b['spent']:.4g} {UNITS[b['unit']]}",
                    f"{b['amount']:g}",
                    f"{b['state']} ({b['fraction']:.0%})",
                    f"{b['burn_per_hour']:.4g}",
                    when(b["runs_out_at"]),
                    b["on_exhausted"],
                )
                for b in budgets
            ],
        )  # fmt: skip
    )
