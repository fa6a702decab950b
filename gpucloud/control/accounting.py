"""Usage and cost: GPU-hours per tenant and per workload, priced from the price book.

Every allocation leaves one usage record (tenant, workload, node, GPU type, GPUs, start,
end); an interval still open counts up to `until`. Intervals are clipped to [since, until]
and priced piecewise at the prices in effect over them (control/price_book.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from gpucloud.control.auth import Principal
from gpucloud.control.models import Deployment, Job, Replica, Tenant, UsageRecord, User
from gpucloud.control.price_book import PriceBook
from gpucloud.control.schemas import UsageLine, UsageReport
from gpucloud.control.services import prices
from gpucloud.control.services import tenants as tenant_service


@dataclass(frozen=True)
class Interval:
    """One usage record clipped to a report's window, with who and what it was for."""

    tenant_id: int
    tenant: str
    user: str
    labels: dict[str, str]
    kind: str  # job | deployment
    id: int
    name: str
    gpu_type: str
    node: str | None
    gpus: float
    start: float
    end: float
    open: bool  # still held
    requested_end: float | None  # a job run's start + its time limit

    @property
    def gpu_hours(self) -> float:
        return max(self.end - self.start, 0.0) * self.gpus / 3600

    @property
    def requested_gpu_hours(self) -> float:
        """GPUs x time limit of a finished run, from the window's start; else what it held."""
        if self.open or self.requested_end is None:
            return self.gpu_hours
        return max(self.requested_end - self.start, self.end - self.start) * self.gpus / 3600

    def cost(self, book: PriceBook) -> float:
        return book.cost(self.gpu_type, self.node, self.gpus, self.start, self.end)


def intervals(
    session: Session, since: float | None, until: float, tenant_ids: Iterable[int] | None = None
) -> list[Interval]:
    """The usage records overlapping [since, until] (of `tenant_ids` if given), clipped."""
    q = (
        select(UsageRecord, Tenant.name, User.name, Job.name, Job.labels, Job.time_limit,
               Deployment.id, Deployment.name, Deployment.labels)
        .join(Tenant, UsageRecord.tenant_id == Tenant.id)
        .outerjoin(Job, UsageRecord.job_id == Job.id)
        .outerjoin(Replica, UsageRecord.replica_id == Replica.id)
        .outerjoin(Deployment, Replica.deployment_id == Deployment.id)
        .outerjoin(User, User.id == func.coalesce(Job.user_id, Deployment.user_id))
        .order_by(UsageRecord.id)
    )  # fmt: skip
    if tenant_ids is not None:
        q = q.where(UsageRecord.tenant_id.in_(list(tenant_ids)))
    if since is not None:
        q = q.where(or_(UsageRecord.ended_at.is_(None), UsageRecord.ended_at > since))
    out = []
    for rec, tenant, user, job, labels, limit, dep_id, dep, dep_labels in session.execute(q):
        is_job = rec.job_id is not None
        out.append(
            Interval(
                tenant_id=rec.tenant_id,
                tenant=tenant,
                user=user or "",
                labels=(labels if is_job else dep_labels) or {},
                kind="job" if is_job else "deployment",
                id=rec.job_id if is_job else dep_id,
                name=job if is_job else dep,
                gpu_type=rec.gpu_type,
                node=rec.node,
                gpus=rec.gpus,
                start=max(rec.started_at, since) if since is not None else rec.started_at,
                end=rec.ended_at if rec.ended_at is not None else until,
                open=rec.ended_at is None,
                requested_end=rec.started_at + limit if is_job and limit else None,
            )
        )
    return out


def visible_tenants(session: Session, who: Principal, tenant: str | None) -> list[int] | None:
    """The tenants whose usage `who` may read: the one named (if allowed), every tenant for
    an operator who names none (None), else the caller's own."""
    if tenant is not None:
        return [tenant_service.get(session, who, tenant).id]
    return None if who.is_operator else [who.tenant_id]


def report(
    session: Session, who: Principal, tenant: str | None = None, since: float | None = None
) -> UsageReport:
    """Usage of the caller's tenant; an operator sees every tenant, or the one named."""
    until = time.time()
    book = prices.book(session)
    lines: dict[tuple[str, str, int], UsageLine] = {}
    for iv in intervals(session, since, until, visible_tenants(session, who, tenant)):
        line = lines.setdefault(
            (iv.tenant, iv.kind, iv.id),
            UsageLine(tenant=iv.tenant, kind=iv.kind, id=iv.id, name=iv.name,
                      gpu_type=iv.gpu_type, gpu_hours=0.0, cost=0.0),
        )  # fmt: skip
        line.gpu_hours += iv.gpu_hours
        line.cost += iv.cost(book)
    totals: dict[str, dict[str, float]] = {}
    for line in lines.values():
        t = totals.setdefault(line.tenant, {"gpu_hours": 0.0, "cost": 0.0})
        t["gpu_hours"] += line.gpu_hours
        t["cost"] += line.cost
    return UsageReport(since=since, until=until, tenants=totals, lines=list(lines.values()))


def label_text(labels: dict[str, Any]) -> str:
    """A workload's labels as one group value: "k=v,k2=v2" by key, or "-" without any."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "-"
