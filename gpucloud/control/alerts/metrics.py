"""The gauges the shipped alert rules need beyond control/metrics.py: each budget's spend,
soft threshold and forecast, the oldest wait in the queue, replica restarts, and the
workloads idle reclaim has warned. Read from the store at each scrape, like the other
gauges, so a restart loses nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import String, cast, func, literal, select

from gpucloud.control.db import Store
from gpucloud.control.lifecycle import JobState, ReplicaState
from gpucloud.control.models import Deployment, Job, Replica, Tenant
from gpucloud.control.services import budgets

_BUDGET = ["tenant", "user", "label", "unit"]


class AlertCollector:
    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = time.time()
        with self.store.reading() as s:
            evaluated = budgets.evaluate(s, now)
            pending = Job.state == JobState.PENDING
            oldest = s.scalar(select(func.min(Job.submitted_at)).where(pending))
            restarts = s.execute(
                select(Tenant.name, Deployment.name, func.sum(Replica.restarts))
                .join(Deployment, Replica.deployment_id == Deployment.id)
                .join(Tenant, Deployment.tenant_id == Tenant.id)
                .where(Replica.state != ReplicaState.STOPPED)
                .group_by(Tenant.name, Deployment.name)
            ).all()
            warned = s.execute(
                select(Tenant.name, literal("deployment"), Deployment.name,
                       Deployment.idle_reclaim_at)
                .join(Tenant, Deployment.tenant_id == Tenant.id)
                .where(Deployment.idle_reclaim_at.is_not(None))
                .union_all(
                    select(Tenant.name, literal("job"), cast(Job.id, String), Job.idle_reclaim_at)
                    .join(Tenant, Job.tenant_id == Tenant.id)
                    .where(Job.idle_reclaim_at.is_not(None))
                )
            ).all()  # fmt: skip
        yield from _budget_gauges(evaluated, now)
        idle = GaugeMetricFamily(
            "gpucloud_idle_reclaim_in_seconds",
            "Workloads warned as idle: seconds until reclaimed (deployments scaled to zero, "
            "interactive jobs stopped) unless used",
            labels=["tenant", "kind", "name"],
        )
        for tenant, kind, name, at in warned:
            idle.add_metric([tenant, kind, name], at - now)
        yield idle
        wait = GaugeMetricFamily(
            "gpucloud_queue_oldest_wait_seconds", "How long the oldest pending job has waited"
        )
        wait.add_metric([], now - oldest if oldest is not None else 0.0)
        yield wait
        restarted = GaugeMetricFamily(
            "gpucloud_replica_restarts",
            "Restarts of a deployment's live replicas, all causes",
            labels=["tenant", "deployment"],
        )
        for tenant, deployment, n in restarts:
            restarted.add_metric([tenant, deployment], n or 0)
        yield restarted


def _budget_gauges(evaluated: list[budgets.Evaluated], now: float) -> Iterator[GaugeMetricFamily]:
    spent = GaugeMetricFamily(
        "gpucloud_budget_spent_ratio", "This month's spend / the budget", labels=_BUDGET
    )
    soft = GaugeMetricFamily(
        "gpucloud_budget_soft_ratio", "The fraction of the budget from which it warns",
        labels=_BUDGET,
    )  # fmt: skip
    runs_out = GaugeMetricFamily(
        "gpucloud_budget_runs_out_in_seconds",
        "At the current burn rate, when the budget is spent (only budgets that run out "
        "before the month ends)",
        labels=_BUDGET,
    )
    for e in evaluated:
        s = e.status
        labels = [s.tenant, s.user, s.label, s.unit]
        spent.add_metric(labels, s.fraction)
        soft.add_metric(labels, s.soft)
        if s.runs_out_at is not None:
            runs_out.add_metric(labels, s.runs_out_at - now)
    yield from (spent, soft, runs_out)
