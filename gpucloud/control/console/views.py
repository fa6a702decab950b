"""What the console shows beyond the API's own answers: who holds which GPU, when each
pending job should start, a job's training curves, a deployment's traffic split over time.
Each takes the caller (or an answer the API gave it) and shows only what the API lets it see.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.control import cluster
from gpucloud.control.auth import Principal
from gpucloud.control.config import Settings
from gpucloud.control.console import serving
from gpucloud.control.executors.base import WorkloadKind, WorkloadRef
from gpucloud.control.lifecycle import REPLICA_HOLDS_GPUS, JobState, ReplicaState
from gpucloud.control.models import Deployment, Job, Replica, Tenant
from gpucloud.control.schemas import DeploymentHistory
from gpucloud.control.services.deployments import DELETED
from gpucloud.scheduler.projection import project_starts
from gpucloud.train.metrics import METRICS_FILE

OTHER = "another tenant"  # what a tenant sees of a GPU held by someone else
# The fields of metrics.jsonl the job page plots (each one chart), and the most points sent.
CURVES = ("loss", "tokens_per_s", "grad_norm")
MAX_POINTS = 2000
MAX_METRICS_BYTES = 8 * 1024 * 1024  # the tail of a longer file is read


def holders(session: Session, who: Principal) -> dict[tuple[str, int], str]:
    """(node, device) -> the tenant holding it, for every GPU a running job or a live
    replica holds. Operators see every tenant's name; a tenant its own and OTHER."""
    jobs = select(Job.placement, Tenant.name, Tenant.id).join(Tenant, Job.tenant_id == Tenant.id)
    replicas = (
        select(Replica.placement, Tenant.name, Tenant.id)
        .join(Deployment, Replica.deployment_id == Deployment.id)
        .join(Tenant, Deployment.tenant_id == Tenant.id)
    )
    rows = [
        *session.execute(jobs.where(Job.state == JobState.RUNNING)),
        *session.execute(replicas.where(Replica.state.in_(REPLICA_HOLDS_GPUS))),
    ]
    held: dict[tuple[str, int], str] = {}
    for placement, tenant, tenant_id in rows:
        shown = tenant if who.is_operator or tenant_id == who.tenant_id else OTHER
        for part in placement or []:
            for device in part["devices"]:
                held[(part["node"], device)] = shown
    return held


@dataclass(frozen=True, slots=True)
class Starts:
    """When each pending job should start (see `estimated_starts`)."""

    by_job: dict[int, float | None]  # epoch seconds; None: the projection cannot tell
    horizon: float | None  # the projection's end if it ran out of passes (later than it)
    at: float = 0.0  # monotonic time it was computed


def estimated_starts(session: Session, settings: Settings, now: float) -> Starts:
    """When each pending job the scheduler may start should start: the whole cluster
    projected forward with the live policy (gpucloud.scheduler.projection). A job kept out
    of the scheduler (held by a budget, no node of its type up) is absent."""
    from gpucloud.control.reconciler import live_policy  # the reconciler imports much

    snap = cluster.load(session)
    projection = project_starts(snap.state, live_policy(settings), now)
    by_job = {}
    for ref, at in projection.starts.items():
        workload = WorkloadRef.parse(ref)
        if workload.kind is WorkloadKind.JOB:
            by_job[workload.id] = at
    return Starts(by_job, projection.horizon, time.monotonic())


@dataclass(slots=True)
class Curves:
    """A job's training curves: the steps, and each field's value at each step (None where
    a record had no finite value)."""

    step: list[float] = field(default_factory=list)
    series: dict[str, list[float | None]] = field(default_factory=lambda: {c: [] for c in CURVES})


def curves(run_dir: Path | None) -> Curves:
    """The records of `run_dir`/metrics.jsonl (events left out), at most MAX_POINTS of the
    newest. The file is the tenant's: opened without following a symlink, and its lines
    read as data only."""
    out = Curves()
    if run_dir is None:
        return out
    for line in _tail(run_dir / METRICS_FILE).splitlines()[-MAX_POINTS:]:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line being written, or the first of a tail
        if not isinstance(record, dict) or "event" in record:
            continue
        step = record.get("step")
        if not isinstance(step, int | float):
            continue
        out.step.append(step)
        for name in CURVES:
            value = record.get(name)
            out.series[name].append(value if isinstance(value, int | float) else None)
    return out


def _tail(path: Path) -> bytes:
    try:  # O_NONBLOCK: a FIFO put in its place must not hang the request
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return b""
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return b""
        f.seek(max(info.st_size - MAX_METRICS_BYTES, 0))
        return f.read(MAX_METRICS_BYTES)


def serving_targets(session: Session, tenant_ids: list[int] | None) -> list[serving.Deployment]:
    """The live deployments of `tenant_ids` (every tenant's if None) with the URLs of their
    READY replicas: what the traffic series sample."""
    q = (
        select(Deployment.id, Tenant.name, Deployment.name)
        .join(Tenant, Deployment.tenant_id == Tenant.id)
        .where(Deployment.state != DELETED)
        .order_by(Deployment.id)
    )
    if tenant_ids is not None:
        q = q.where(Deployment.tenant_id.in_(tenant_ids))
    deps = session.execute(q).all()
    urls: dict[int, dict[int, str]] = {dep_id: {} for dep_id, _, _ in deps}
    ready = select(Replica.deployment_id, Replica.id, Replica.url).where(
        Replica.deployment_id.in_(list(urls)),
        Replica.state == ReplicaState.READY,
        Replica.url.is_not(None),
    )
    for dep_id, rid, url in session.execute(ready):
        urls[dep_id][rid] = url
    return [serving.Deployment(i, tenant, name, urls[i]) for i, tenant, name in deps]


def traffic_split(history: DeploymentHistory, now: float) -> dict:
    """The deployment's split over time, as its history tells it: the time of each change
    and `now`, and for each version the percent of the requests it had from each of those
    times on (None while it was not served). The page draws them as steps."""
    at = [e.at for e in history.events] + [now]
    splits = [e.traffic for e in history.events]
    splits.append(splits[-1] if splits else {})
    numbers = sorted({int(n) for split in splits for n in split})
    versions = [{"version": n, "percent": [split.get(str(n)) for split in splits]} for n in numbers]
    return {"at": at, "versions": versions}
