"""GPU-hours and cost per tenant over the days of this month (UTC), against each tenant's
quota and budget: what the usage page charts.

The usage is accounting's (the same usage records and price book as `gpucloud usage`),
cut at day boundaries and summed up day by day; a quota of G GPUs allows G GPU-hours per
hour of the month; a tenant-wide budget (no user, no label) is a line at its amount, in
GPU-hours or USD.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from datetime import UTC, datetime

from sqlalchemy.orm import Session

from gpucloud.control import accounting
from gpucloud.control.accounting import Interval
from gpucloud.control.auth import Principal
from gpucloud.control.price_book import PriceBook
from gpucloud.control.services import budgets, prices
from gpucloud.control.services import tenants as tenant_service

DAY = 86400.0


def by_day(
    intervals: Iterable[Interval], book: PriceBook, start: float, days: int
) -> dict[str, tuple[list[float], list[float]]]:
    """Tenant -> (GPU-hours, USD) used on each of the `days` days from `start`."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for iv in intervals:
        hours, cost = out.setdefault(iv.tenant, ([0.0] * days, [0.0] * days))
        first = max(int((iv.start - start) // DAY), 0)
        last = min(int(math.ceil((iv.end - start) / DAY)), days)
        for d in range(first, last):
            lo, hi = start + d * DAY, start + (d + 1) * DAY
            piece = dataclasses.replace(iv, start=max(iv.start, lo), end=min(iv.end, hi))
            if piece.end > piece.start:
                hours[d] += piece.gpu_hours
                cost[d] += piece.cost(book)
    return out


def running_total(values: list[float]) -> list[float]:
    out, total = [], 0.0
    for v in values:
        total += v
        out.append(total)
    return out


def month(session: Session, who: Principal, tenant: str | None, now: float) -> dict:
    """This month's series for the tenants `who` may read (the one named, if any): days
    1..N, and per tenant its cumulative GPU-hours and cost up to today, the GPU-hours its
    quota allows by the end of each day (None: no quota) and its tenant-wide budgets."""
    start, end = budgets.month_bounds(now)
    days = round((end - start) / DAY)
    today = min(int((now - start) // DAY) + 1, days)
    ids = accounting.visible_tenants(session, who, tenant)
    used = by_day(accounting.intervals(session, start, now, ids), prices.book(session), start, days)
    shown = [t for t in tenant_service.list_(session, who) if ids is None or t.id in ids]
    budget_lines: dict[str, dict[str, float]] = {}
    for b in budgets.list_(session, who, tenant):
        if not b.user and not b.label:
            budget_lines.setdefault(b.tenant, {})[b.unit] = b.amount
    series = []
    for t in shown:
        hours, cost = used.get(t.name, ([0.0] * days, [0.0] * days))
        quota = sum(q.gpus for q in t.quotas)
        series.append(
            {
                "tenant": t.name,
                "gpu_hours": running_total(hours)[:today],
                "cost": running_total(cost)[:today],
                "quota_gpu_hours": [quota * 24 * (d + 1) for d in range(days)] if quota else None,
                "budgets": budget_lines.get(t.name, {}),
            }
        )
    month_name = datetime.fromtimestamp(start, UTC).strftime("%Y-%m")
    return {"month": month_name, "days": list(range(1, days + 1)), "tenants": series}
