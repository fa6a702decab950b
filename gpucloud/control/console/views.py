"""What the console shows beyond the API's own answers: who holds which GPU, a job's
training curves, the gateway's traffic per deployment. Each takes the caller (or its
tenant) and shows only what the API lets it see.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.control.auth import Principal
from gpucloud.control.lifecycle import REPLICA_HOLDS_GPUS, JobState
from gpucloud.control.metrics import Metrics
from gpucloud.control.models import Deployment, Job, Replica, Tenant
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


@dataclass(slots=True)
class Traffic:
    requests: int = 0
    errors: int = 0  # answered with a status of 400 or more


def traffic(metrics: Metrics, tenant: str) -> dict[str, Traffic]:
    """Requests the /v1 gateway relayed to each of `tenant`'s deployments since the control
    plane started, and how many failed: its own Prometheus counter, read in place."""
    out: dict[str, Traffic] = {}
    for family in metrics.gateway_requests.collect():
        for sample in family.samples:
            labels = sample.labels
            if not sample.name.endswith("_total") or labels["tenant"] != tenant:
                continue
            t = out.setdefault(labels["deployment"], Traffic())
            t.requests += int(sample.value)
            if int(labels["status"]) >= 400:
                t.errors += int(sample.value)
    return out
