"""Usage and cost: GPU-hours per tenant and per workload, priced from the hardware catalog.

Every allocation leaves one usage record (tenant, workload, GPU type, GPUs, start, end);
an interval still open counts up to `until`. Intervals are clipped to [since, until].
"""

from __future__ import annotations

import time

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from gpucloud import hardware
from gpucloud.control.auth import Principal
from gpucloud.control.models import Deployment, Job, Replica, Tenant, UsageRecord
from gpucloud.control.schemas import UsageLine, UsageReport
from gpucloud.control.services import tenants as tenant_service


def report(
    session: Session, who: Principal, tenant: str | None = None, since: float | None = None
) -> UsageReport:
    """Usage of the caller's tenant; an operator sees every tenant, or the one named."""
    until = time.time()
    q = (
        select(UsageRecord, Tenant.name, Job.name, Deployment.id, Deployment.name)
        .join(Tenant, UsageRecord.tenant_id == Tenant.id)
        .outerjoin(Job, UsageRecord.job_id == Job.id)
        .outerjoin(Replica, UsageRecord.replica_id == Replica.id)
        .outerjoin(Deployment, Replica.deployment_id == Deployment.id)
        .order_by(UsageRecord.id)
    )
    if tenant is not None:
        q = q.where(UsageRecord.tenant_id == tenant_service.get(session, who, tenant).id)
    elif not who.is_operator:
        q = q.where(UsageRecord.tenant_id == who.tenant_id)
    if since is not None:
        q = q.where(or_(UsageRecord.ended_at.is_(None), UsageRecord.ended_at > since))
    lines: dict[tuple[str, str, int], UsageLine] = {}
    for rec, tenant_name, job_name, dep_id, dep_name in session.execute(q):
        start = max(rec.started_at, since) if since is not None else rec.started_at
        end = rec.ended_at if rec.ended_at is not None else until
        hours = max(end - start, 0.0) * rec.gpus / 3600
        kind, wid, name = (
            ("job", rec.job_id, job_name) if rec.job_id else ("deployment", dep_id, dep_name)
        )
        line = lines.setdefault(
            (tenant_name, kind, wid),
            UsageLine(
                tenant=tenant_name,
                kind=kind,
                id=wid,
                name=name,
                gpu_type=rec.gpu_type,
                gpu_hours=0.0,
                cost=0.0,
            ),
        )
        line.gpu_hours += hours
        line.cost += hours * _price(rec.gpu_type)
    totals: dict[str, dict[str, float]] = {}
    for line in lines.values():
        t = totals.setdefault(line.tenant, {"gpu_hours": 0.0, "cost": 0.0})
        t["gpu_hours"] += line.gpu_hours
        t["cost"] += line.cost
    return UsageReport(since=since, until=until, tenants=totals, lines=list(lines.values()))


def _price(gpu_type: str) -> float:
    return hardware.get(gpu_type).price_per_hour
