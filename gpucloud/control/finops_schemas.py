"""Request and response bodies of prices, showback and budgets (pydantic)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StringConstraints, field_validator

from gpucloud.control.schemas import _gpu_type, _Spec

# A node or job label a price pool or a budget is narrowed to: "key=value".
LabelSelector = Annotated[
    str,
    StringConstraints(
        strip_whitespace=True, max_length=127, pattern=r"^([A-Za-z0-9][A-Za-z0-9._/-]*=[^=\x00]*)?$"
    ),
]
Unit = Literal["gpu_hours", "usd"]
UNIT_NAMES = {"gpu_hours": "GPU-hours", "usd": "USD"}


class PriceSet(_Spec):
    gpu_type: str = Field(description="a catalog name, e.g. H100-SXM")
    pool: LabelSelector = Field(
        default="", description="only the nodes with this label (key=value); all if empty"
    )
    per_hour: float = Field(ge=0, le=10_000, allow_inf_nan=False, description="USD per GPU-hour")
    effective_from: float | None = Field(
        default=None, ge=0, le=1e11, description="epoch seconds, now or later; now if unset"
    )

    _check_type = field_validator("gpu_type")(_gpu_type)


class PricePublic(BaseModel):
    gpu_type: str
    pool: str
    per_hour: float
    effective_from: float
    effective_until: float | None = Field(description="when the next version takes over")
    created_at: float


class ShowbackRow(BaseModel):
    group: dict[str, str] = Field(description="the value of each --by dimension")
    gpu_hours: float = Field(description="GPU-hours held (what is billed)")
    requested_gpu_hours: float = Field(
        description="GPU-hours asked for: GPUs x time limit for each finished run of a job "
        "with a time limit; what was held for the others (not measurable)"
    )
    waste_gpu_hours: float = Field(description="requested minus held")
    cost: float = Field(description="USD at the prices in effect over each interval")


class Showback(BaseModel):
    since: float | None
    until: float
    by: list[str]
    rows: list[ShowbackRow]


class BudgetSet(_Spec):
    user: Annotated[str, StringConstraints(max_length=63)] = Field(
        default="", description="only this user's work; the whole tenant if empty"
    )
    label: LabelSelector = Field(
        default="",
        description="only jobs and deployments with this label (key=value); all if empty",
    )
    unit: Unit
    amount: float = Field(gt=0, le=1e12, allow_inf_nan=False, description="per calendar month")
    soft: float = Field(
        default=0.8, gt=0, le=1, description="the fraction of amount from which it warns"
    )
    on_exhausted: Literal["queue", "stop"] = Field(
        default="queue",
        description="queue: new jobs and replicas wait; stop: running jobs are stopped too",
    )


class BudgetStatus(BaseModel):
    tenant: str
    user: str
    label: str
    unit: Unit
    amount: float
    soft: float
    on_exhausted: str
    month: str = Field(description="the calendar month (UTC) it counts, YYYY-MM")
    spent: float = Field(description="in `unit`, this month so far")
    fraction: float = Field(description="spent / amount")
    state: Literal["ok", "warning", "exhausted"]
    burn_per_hour: float = Field(description="in `unit`, at the work running now")
    runs_out_at: float | None = Field(
        description="at the current burn rate, before the month ends; None if not"
    )
