"""Jobs: submit, read, cancel, and the one function that moves a job between states."""

from __future__ import annotations

import time
from types import SimpleNamespace

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from gpucloud.control import db, idle_policy
from gpucloud.control.auth import Principal
from gpucloud.control.errors import ConflictError
from gpucloud.control.lifecycle import FINISHED, JobState, Role, check_job_transition
from gpucloud.control.models import Job, JobEvent, ModelVersion, Tenant
from gpucloud.control.run_estimate import planned_seconds
from gpucloud.control.schemas import JobEventPublic, JobPublic, JobSpec, gpu_milli, gpus_of
from gpucloud.control.services import audit, budgets, capacity, nodes, registry
from gpucloud.errors import GpucloudError, NotFoundError


def submit(session: Session, who: Principal, spec: JobSpec) -> JobPublic:
    """Queue a job. Raises CapacityError when no node pool or quota could ever hold it."""
    (result,) = submit_many(session, [(who, spec)])
    if isinstance(result, Exception):
        raise result
    return result


def submit_many(
    session: Session, requests: list[tuple[Principal, JobSpec]]
) -> list[JobPublic | GpucloudError]:
    """Queue several jobs in the caller's transaction: for each request its job, or the
    error that refused it (a refused job does not keep the others out).

    The API's submissions arrive here in batches (db.GroupCommit), so each table gets one
    multi-row INSERT per batch, on the session's connection, rather than an ORM flush per
    job: at a batch of 8 that is a fifth of the cost per job (the ORM's bulk INSERT, a
    third more than the connection's), and it is what a submission holds SQLite's write
    lock for.
    """
    admission = capacity.Admission(session)
    now = time.time()
    results: list[JobPublic | GpucloudError | None] = []
    accepted: list[tuple[int, Principal, dict]] = []  # (place in results, caller, columns)
    for who, spec in requests:
        try:
            who.require(Role.MEMBER)
            req = capacity.Request.of(spec.gpus, spec.gpu_type, spec.cpus, spec.memory_gib)
            admission.check(who.tenant_id, req)
            model = registry.resolve(session, who, spec.model) if spec.model else None
        except GpucloudError as e:
            results.append(e)
            continue
        plan_type = spec.gpu_type
        if spec.train is not None and plan_type is None:  # the largest pool (check: one fits)
            plan_type = max(admission.pools().items(), key=lambda pool: pool[1])[0]
        accepted.append((len(results), who, _columns(who, spec, req, model, now, plan_type)))
        results.append(None)
    if not accepted:
        return results
    told = budgets.warnings(session, [(who, c["labels"]) for _, who, c in accepted], now)
    conn = session.connection()
    ids = db.new_ids(conn, Job.__table__, len(accepted))
    event = {"at": now, "from_state": None, "to_state": JobState.PENDING, "reason": "submitted"}
    with db.unread(conn):  # the jobs, their events and the audit entries: one round trip
        rows = [{**c, "id": job_id} for (_, _, c), job_id in zip(accepted, ids, strict=True)]
        conn.execute(insert(Job.__table__).inline(), rows)
        conn.execute(
            insert(JobEvent.__table__).inline(), [{**event, "job_id": job_id} for job_id in ids]
        )
        audit.record_all(
            session,
            [
                audit.entry(who, "job.submit", f"job/{job_id}", name=c["name"], gpus=c["gpus"])
                for (_, who, c), job_id in zip(accepted, ids, strict=True)
            ],
        )
    # Each answer is read off the columns just inserted, not off ORM instances: building a
    # Job and a JobEvent per submission cost as much as the two INSERTs.
    submitted = [SimpleNamespace(**event)]
    for (place, who, columns), job_id, warnings in zip(accepted, ids, told, strict=True):
        job = SimpleNamespace(id=job_id, **_NOT_YET, **columns)
        results[place] = _public(job, who.tenant_name, {}, submitted)  # type: ignore[arg-type]
        results[place].warnings = warnings
    return results


# The columns of a job that _columns leaves to later: how it ran and ended.
_NOT_YET = {"exit_code": None, "reason": None, "node_id": None, "started_at": None,
            "finished_at": None, "idle_reclaim_at": None}  # fmt: skip


def _columns(
    who: Principal,
    spec: JobSpec,
    req: capacity.Request,
    model: ModelVersion | None,
    now: float,
    plan_type: str | None,
) -> dict:
    """The row of a job just submitted. `plan_type`: the GPU type its run time is planned
    on (its own, else the cluster's largest pool)."""
    gpus, milli = gpu_milli(spec.gpus)
    return {
        "tenant_id": who.tenant_id,
        "user_id": who.user_id,
        "name": spec.name,
        "command": spec.command,
        "train_config": spec.train,
        "model_ref": registry.ref_of(model) if model else None,
        "model_dir": model.uri if model else None,
        "gpus": gpus,
        "gpu_milli": milli,
        "gpu_type": spec.gpu_type,
        "cpu_milli": req.cpu_milli,
        "memory_mib": req.memory_mib,
        "priority": spec.priority,
        "preemptible": spec.preemptible,
        "max_retries": spec.max_retries,
        "env": spec.env,
        "workdir": spec.workdir,
        "checkpoint_dir": spec.checkpoint_dir,
        "time_limit": spec.time_limit,
        "planned_seconds": planned_seconds(
            spec.train, model.uri if model else None, plan_type, gpus
        ),
        "labels": spec.labels,
        "interactive": spec.interactive,
        "idle_ttl": spec.idle_ttl,
        "state": JobState.PENDING,
        "attempts": 0,
        "preemptions": 0,
        "requeues": 0,
        "devices": [],
        "placement": [],
        "not_before": 0.0,
        "cancel_requested": False,
        "submitted_at": now,
    }


def list_(
    session: Session, who: Principal, state: JobState | None = None, limit: int = 1000
) -> list[JobPublic]:
    return list_of(session, [who.tenant_id], state, limit)


def list_of(
    session: Session, tenant_ids: list[int] | None, state: JobState | None = None, limit: int = 1000
) -> list[JobPublic]:
    """The newest jobs of `tenant_ids` (of every tenant if None), for a caller allowed to
    read them (accounting.visible_tenants)."""
    q = select(Job, Tenant.name).join(Tenant, Job.tenant_id == Tenant.id)
    q = q.order_by(Job.id.desc()).limit(limit)
    if tenant_ids is not None:
        q = q.where(Job.tenant_id.in_(tenant_ids))
    if state is not None:
        q = q.where(Job.state == state)
    node_names = nodes.names(session)
    return [_public(j, tenant, node_names, []) for j, tenant in session.execute(q)]


def get(session: Session, who: Principal, job_id: int) -> Job:
    """The caller's job `job_id`; another tenant's job is NotFoundError, as a missing one."""
    job = session.get(Job, job_id)
    if job is None or job.tenant_id != who.tenant_id:
        raise NotFoundError(f"no job {job_id}")
    return job


def cancel(session: Session, who: Principal, job_id: int) -> JobPublic:
    """Cancel a job: at once if it waits, through the reconciler (SIGTERM) if it runs."""
    who.require(Role.MEMBER)
    job = get(session, who, job_id)
    if job.state in FINISHED:
        raise ConflictError(f"job {job_id} already finished ({job.state})")
    if job.state == JobState.RUNNING:
        job.cancel_requested = True
    else:
        transition(session, job, JobState.CANCELLED, f"cancelled by {who.user_name}")
    audit.record(session, who, "job.cancel", f"job/{job.id}")
    return public(session, job, who.tenant_name)


def transition(
    session: Session, job: Job, to: JobState, reason: str | None = None, now: float | None = None
) -> None:
    """Move `job` to `to` and record the event, in the caller's transaction."""
    check_job_transition(job.id, job.state, to)
    now = time.time() if now is None else now
    session.add(JobEvent(job_id=job.id, at=now, from_state=job.state, to_state=to, reason=reason))
    job.state = to
    job.reason = reason
    if to in FINISHED:
        job.finished_at = now


def public(session: Session, job: Job, tenant_name: str | None = None) -> JobPublic:
    if tenant_name is None:
        tenant_name = session.get(Tenant, job.tenant_id).name
    events = session.scalars(
        select(JobEvent).where(JobEvent.job_id == job.id).order_by(JobEvent.id)
    ).all()
    return _public(job, tenant_name, nodes.names(session), events)


def _public(job: Job, tenant: str, node_names: dict[int, str], events: list[JobEvent]) -> JobPublic:
    return JobPublic(
        id=job.id,
        tenant=tenant,
        name=job.name,
        command=job.command,
        train=job.train_config,
        model=job.model_ref,
        gpus=gpus_of(job.gpus * job.gpu_milli),
        gpu_type=job.gpu_type,
        cpus=capacity.cpus(job.cpu_milli),
        memory_gib=capacity.gib(job.memory_mib),
        priority=job.priority,
        preemptible=job.preemptible,
        max_retries=job.max_retries,
        env=job.env,
        workdir=job.workdir,
        checkpoint_dir=job.checkpoint_dir,
        time_limit=job.time_limit,
        labels=job.labels or {},
        interactive=job.interactive,
        idle_ttl=job.idle_ttl,
        idle=idle_policy.job_notice(job.idle_reclaim_at),
        state=job.state,
        attempts=job.attempts,
        preemptions=job.preemptions,
        requeues=job.requeues,
        exit_code=job.exit_code,
        reason=job.reason,
        node=node_names.get(job.node_id) if job.node_id else None,
        devices=job.devices,
        placement=job.placement,
        submitted_at=job.submitted_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        events=[
            JobEventPublic(at=e.at, from_state=e.from_state, to_state=e.to_state, reason=e.reason)
            for e in events
        ],
    )
