"""Idle reclaim: deployments without traffic and interactive jobs whose accelerators sit
idle give their GPUs back, warned first and audited after. Each reconciler pass:

    load the candidates -> see how long each has been idle -> warn | reclaim | wake

A deployment is idle while it has a ready replica and the /v1 gateway relays it no
request (its clock starts when its newest replica became ready). An interactive job is
idle while its accelerators are: utilisation at most `BUSY_UTILISATION` percent where its
node's telemetry reports its devices (control/executors: the local node's), else while
its log and metrics.jsonl do not grow. The TTL in force is the workload's own, else its
tenant's, else the cluster's (idle_policy.ttl).

At `WARN_AT` of its TTL a workload is warned: an audit entry (`deployment.idle_warning`,
`job.idle_warning`), a line in its view with the time it will be reclaimed, and the
gpucloud_idle_reclaim_in_seconds gauge. At its TTL:
- a deployment is scaled to zero, not deleted: its name, settings and routes stay, and
  the next request through the gateway waits while its replicas start again (a deleted
  one would answer 404 and need its owner to create it again);
- an interactive job is stopped as a cancel is (SIGTERM, so it can save its work; SIGKILL
  after the grace period) and ends CANCELLED with the reason.
Both are audited (`*.idle_reclaim`, and `deployment.idle_wake` when a request wakes it).
Activity after the warning clears it. Idle clocks start no earlier than this control
plane: after a restart each workload has its whole TTL again, never less.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import select

from gpucloud.control import idle_policy, workloads
from gpucloud.control.config import Settings
from gpucloud.control.db import Store
from gpucloud.control.lifecycle import JobState, ReplicaState
from gpucloud.control.models import Deployment, Job, Replica, Tenant
from gpucloud.control.services import audit
from gpucloud.control.services import deployments as deployment_service

if TYPE_CHECKING:
    from gpucloud.control.gateway import Gateway
    from gpucloud.hal.telemetry import Monitor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    """What one pass does to one workload: warn, reclaim, clear a warning, or wake."""

    action: str  # warn | reclaim | clear | wake
    kind: str  # deployment | job
    id: int
    reclaim_at: float | None = None
    why: str = ""


class IdleReclaimer:
    def __init__(self, settings: Settings, gateway: Gateway, telemetry: Monitor | None) -> None:
        self.settings = settings
        self.gateway = gateway
        self.telemetry = telemetry
        self.started = time.time()
        self._busy: dict[int, float] = {}  # job id -> when telemetry last saw it busy

    def apply(self, store: Store, now: float) -> None:
        """One pass: load, judge (no transaction open: it reads files and telemetry), act."""
        with store.reading() as s:
            deps = _deployments(s)
            jobs = _interactive_jobs(s)
            ready = _ready_replicas(s, [d.id for d, _ in deps])
        verdicts = [v for d, t in deps if (v := self._judge_deployment(d, t, ready, now))]
        verdicts += [v for j, t in jobs if (v := self._judge_job(j, t, now))]
        self._busy = {j.id: at for j, _ in jobs if (at := self._busy.get(j.id)) is not None}
        if not verdicts:
            return
        with store.transaction() as s:
            for v in verdicts:
                _act(s, v, now)
        if any(v.kind == "deployment" for v in verdicts):
            self.gateway.forget_routes()  # a route of a reclaimed one names no replica

    def _judge_deployment(
        self, dep: Deployment, tenant: Tenant, ready: dict[int, dict[int, float]], now: float
    ) -> Verdict | None:
        if dep.reclaimed_replicas is not None:
            waiting = self.gateway.cold_waiting.get(dep.id, 0)
            return Verdict("wake", "deployment", dep.id) if waiting else None
        ttl = idle_policy.ttl(dep.idle_ttl, tenant.idle_ttl, self.settings.idle_ttl)
        serving = ready.get(dep.id, {})
        in_flight = sum(self.gateway.balancer.in_flight.get(r, 0) for r in serving)
        if ttl is None or not serving or in_flight:  # loading, or in use: not idle
            return _clear("deployment", dep.id, dep.idle_reclaim_at)
        # idle from its newest replica's first moment ready, or its last request
        last = max(self.started, self.gateway.last_request.get(dep.id, 0.0), *serving.values())
        why = f"no request for {idle_policy.idle_for(now - last)}"
        return _judge("deployment", dep.id, dep.idle_reclaim_at, last, ttl, now, why)

    def _judge_job(self, job: Job, tenant: Tenant, now: float) -> Verdict | None:
        ttl = idle_policy.ttl(job.idle_ttl, tenant.idle_ttl, self.settings.idle_ttl)
        if ttl is None or job.cancel_requested:
            return _clear("job", job.id, job.idle_reclaim_at)
        used = self._utilisation(job)
        if used is not None:
            if used > idle_policy.BUSY_UTILISATION:
                self._busy[job.id] = now
            last = max(job.started_at or now, self.started, self._busy.get(job.id, 0.0))
            how = f"its accelerators' utilisation at most {idle_policy.BUSY_UTILISATION:g}%"
        else:
            last = max(job.started_at or now, self.started, self._progress(job, tenant))
            how = "no new output in its log or metrics.jsonl"
        why = f"idle for {idle_policy.idle_for(now - last)} ({how})"
        return _judge("job", job.id, job.idle_reclaim_at, last, ttl, now, why)

    def _utilisation(self, job: Job) -> float | None:
        """The busiest of the job's devices (percent), when telemetry reports all of them."""
        if self.telemetry is None:
            return None
        here = [p for p in job.placement if p["node"] == self.settings.node_name]
        if len(here) != len(job.placement) or not here:
            return None  # on other nodes: their telemetry does not reach this process
        seen = {s.index: s.utilization for s in self.telemetry.latest()}
        used = [seen.get(d) for d in here[0]["devices"]]
        return None if any(u is None for u in used) else max(used, default=None)

    def _progress(self, job: Job, tenant: Tenant) -> float:
        """When the job last wrote to its log or its metrics.jsonl (0: never)."""
        run_dir = workloads.job_run_dir(self.settings, job, tenant.name)
        paths = [Path(job.log_path)] if job.log_path else []
        paths += [run_dir / "metrics.jsonl"] if run_dir is not None else []
        stamps = [0.0]
        for path in paths:
            with contextlib.suppress(OSError):  # not written yet
                stamps.append(path.stat().st_mtime)
        return max(stamps)


def _judge(
    kind: str, wid: int, warned: float | None, last: float, ttl: float, now: float, why: str
) -> Verdict | None:
    """Warned first, always: one found past its whole TTL unwarned is warned now and
    reclaimed at the next pass."""
    idle = now - last
    if idle < idle_policy.WARN_AT * ttl:
        return _clear(kind, wid, warned)
    if warned is None:
        return Verdict("warn", kind, wid, last + ttl, why)
    return Verdict("reclaim", kind, wid, why=why) if idle >= ttl else None


def _clear(kind: str, wid: int, warned: float | None) -> Verdict | None:
    return Verdict("clear", kind, wid) if warned is not None else None


def _deployments(s) -> list[tuple[Deployment, Tenant]]:
    return list(
        s.execute(
            select(Deployment, Tenant)
            .join(Tenant, Deployment.tenant_id == Tenant.id)
            .where(Deployment.state == deployment_service.ACTIVE)
        ).tuples()
    )


def _interactive_jobs(s) -> list[tuple[Job, Tenant]]:
    return list(
        s.execute(
            select(Job, Tenant)
            .join(Tenant, Job.tenant_id == Tenant.id)
            .where(Job.state == JobState.RUNNING, Job.interactive)
        ).tuples()
    )


def _ready_replicas(s, dep_ids: list[int]) -> dict[int, dict[int, float]]:
    """deployment id -> its READY replicas: id -> when it became ready."""
    out: dict[int, dict[int, float]] = {}
    for dep_id, rid, ready_at in s.execute(
        select(Replica.deployment_id, Replica.id, Replica.ready_at).where(
            Replica.deployment_id.in_(dep_ids), Replica.state == ReplicaState.READY
        )
    ):
        out.setdefault(dep_id, {})[rid] = ready_at or 0.0
    return out


def _act(s, v: Verdict, now: float) -> None:
    """Apply one verdict to its row, if the row still allows it (a pass decides on a read
    that an API call may have changed since)."""
    row = s.get(Deployment if v.kind == "deployment" else Job, v.id)
    live = (
        row.state == deployment_service.ACTIVE
        if v.kind == "deployment"
        else row.state == JobState.RUNNING and not row.cancel_requested
    )
    if not live:
        return
    target = f"deployment/{row.name}" if v.kind == "deployment" else f"job/{row.id}"
    if v.action == "clear":
        row.idle_reclaim_at = None
    elif v.action == "warn":
        row.idle_reclaim_at = v.reclaim_at
        audit.record(s, None, f"{v.kind}.idle_warning", target, tenant_id=row.tenant_id,
                     reclaim_at=v.reclaim_at, why=v.why)  # fmt: skip
        log.warning("%s idle (%s): reclaimed at %s", target, v.why, idle_policy.at(v.reclaim_at))
    elif v.action == "wake":
        replicas, row.reclaimed_replicas = row.reclaimed_replicas, None
        deployment_service.resize(s, row, replicas)
        audit.record(s, None, "deployment.idle_wake", target, tenant_id=row.tenant_id,
                     replicas=replicas)  # fmt: skip
    elif v.kind == "deployment":
        row.idle_reclaim_at, row.reclaimed_replicas = None, row.replicas
        deployment_service.resize(s, row, 0)
        audit.record(s, None, "deployment.idle_reclaim", target, tenant_id=row.tenant_id,
                     done="scaled to zero", replicas=row.reclaimed_replicas,
                     why=v.why)  # fmt: skip
    else:
        row.idle_reclaim_at = None
        row.cancel_requested, row.stop_reason = True, f"{v.why}: stopped"
        audit.record(s, None, "job.idle_reclaim", target, tenant_id=row.tenant_id,
                     done="stopped", why=v.why)  # fmt: skip
