"""`gpucloud quota`: cap a tenant's GPUs per type."""

from __future__ import annotations

from typing import Annotated

import typer

from gpucloud.cli.login import client
from gpucloud.cli.output import JsonFlag, console, emit

app = typer.Typer(
    help="Quotas: GPUs a tenant may hold at once, per GPU type.", no_args_is_help=True
)


@app.command("set")
def set_(
    tenant: Annotated[str, typer.Argument(help="Tenant name.")],
    gpu_type: Annotated[str, typer.Argument(help="GPU type from the catalog, e.g. H100-SXM.")],
    gpus: Annotated[int, typer.Argument(min=0, help="GPUs the tenant may hold at once.")],
    as_json: JsonFlag = False,
) -> None:
    """Set TENANT's quota of GPU_TYPE to GPUS (operators only)."""
    t = client().put(f"/tenants/{tenant}/quotas/{gpu_type}", {"gpus": gpus})
    emit(
        t,
        as_json,
        lambda t: console.print(
            f"tenant {t['name']} quotas: "
            + ", ".join(f"{q['gpus']} x {q['gpu_type']}" for q in t["quotas"]),
            highlight=False,
        ),
    )
