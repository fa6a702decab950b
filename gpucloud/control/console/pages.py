"""The console's pages (GET): each reads through the API's own service functions, with the
caller's principal, so it shows what the API would answer that caller. An operator sees
every tenant's objects, or one tenant's (`?tenant=NAME`), as the usage API shows them
(accounting.visible_tenants); anyone else sees its own tenant's only."""

from __future__ import annotations

import time
from collections import Counter
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session

from gpucloud.control import accounting, logs
from gpucloud.control.auth import Principal
from gpucloud.control.console import simulator, usage_series, views
from gpucloud.control.console.render import PREFIX, page
from gpucloud.control.console.session import Viewer
from gpucloud.control.deps import Db
from gpucloud.control.executors.base import WorkloadRef
from gpucloud.control.lifecycle import FINISHED, JobState
from gpucloud.control.routes import deployments as deployment_routes
from gpucloud.control.routes.deployments import DeploymentName
from gpucloud.control.routes.jobs import JobId
from gpucloud.control.services import deployments, nodes, tenants
from gpucloud.control.services import jobs as job_service
from gpucloud.control.workloads import job_run_dir

router = APIRouter(prefix=PREFIX, include_in_schema=False)
TenantFilter = Annotated[str | None, Query(max_length=63)]
STARTS_TTL = 5.0  # seconds an estimated-start projection is shown before the next one


def _scope(db: Session, who: Principal, tenant: str | None) -> dict:
    """The tenants a page shows (None: every tenant's) and what its tenant filter offers."""
    tenant = tenant or None
    ids = accounting.visible_tenants(db, who, tenant)  # NotFoundError: not the caller's
    names = [t.name for t in tenants.list_(db, who)] if who.is_operator else []
    return {"tenant_ids": ids, "tenant": tenant, "tenant_names": names}


@router.get("/")
def cluster(request: Request, db: Db, who: Viewer):
    node_list = nodes.list_(db, who)
    held = views.holders(db, who)
    return page(request, "cluster", who, nodes=node_list, held=held)


@router.get("/queues")
def queues(request: Request, db: Db, who: Viewer, tenant: TenantFilter = None):
    scope = _scope(db, who, tenant)
    ids = scope["tenant_ids"]
    pending = job_service.list_of(db, ids, JobState.PENDING)
    held = Counter(views.holders(db, who).values())
    shown = [t for t in tenants.list_(db, who) if ids is None or t.id in ids]
    return page(request, "queues", who, pending=pending, tenants=shown, held=held,
                starts=_starts(request, db), **scope)  # fmt: skip


def _starts(request: Request, db: Session) -> views.Starts:
    """The estimated starts, projected at most every STARTS_TTL seconds for all viewers:
    a projection costs up to a few hundred live scheduling passes."""
    state = request.app.state
    cached = getattr(state, "console_starts", None)
    if cached is None or time.monotonic() - cached.at >= STARTS_TTL:
        cached = state.console_starts = views.estimated_starts(db, state.settings, time.time())
    return cached


@router.get("/jobs")
def jobs(
    request: Request,
    db: Db,
    who: Viewer,
    state: JobState | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 200,
    tenant: TenantFilter = None,
):
    scope = _scope(db, who, tenant)
    rows = job_service.list_of(db, scope["tenant_ids"], state, limit)
    return page(request, "jobs", who, jobs=rows, state=state, states=list(JobState), **scope)


@router.get("/jobs/{job_id}")
def job(request: Request, job_id: JobId, db: Db, who: Viewer):
    found = job_service.get(db, who, job_id)  # 404 for another tenant's job
    return page(request, "job", who, job=job_service.public(db, found, who.tenant_name))


@router.get("/jobs/{job_id}/log")
def job_log(
    request: Request,
    job_id: JobId,
    db: Db,
    who: Viewer,
    offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
):
    """The job's output from `offset` on (a chunk at most), and whether more may come."""
    found = job_service.get(db, who, job_id)
    path = request.app.state.settings.log_path(WorkloadRef.job(job_id))
    data = logs.read_from(path, offset)
    more = len(data) == logs.CHUNK or found.state not in FINISHED
    text = data.decode(errors="replace")
    return JSONResponse({"offset": offset + len(data), "text": text, "more": more})


@router.get("/jobs/{job_id}/curves")
def job_curves(request: Request, job_id: JobId, db: Db, who: Viewer):
    """The job's training curves from its run's metrics.jsonl (empty if it writes none)."""
    found = job_service.get(db, who, job_id)
    run_dir = job_run_dir(request.app.state.settings, found, who.tenant_name)
    c = views.curves(run_dir)
    return JSONResponse({"step": c.step, "series": c.series, "done": found.state in FINISHED})


@router.get("/deployments")
def deployment_list(request: Request, db: Db, who: Viewer, tenant: TenantFilter = None):
    return page(request, "deployments", who, **deployments_view(db, who, tenant))


@router.get("/deployments/series")
async def deployment_series(request: Request, who: Viewer, tenant: TenantFilter = None):
    """Each shown deployment's request rate, errors and TTFT/TPOT percentiles over time."""
    store = request.app.state.store

    def targets():
        with store.reading() as db:
            return views.serving_targets(db, accounting.visible_tenants(db, who, tenant or None))

    deps = await run_in_threadpool(targets)
    sampler = request.app.state.console_serving
    found = await sampler.series(request.app.state.gateway.http, deps)
    rows = [{"id": d.id, "tenant": d.tenant, "name": d.name, **found[d.id]} for d in deps]
    return JSONResponse({"deployments": rows})


@router.get("/deployments/{name}/versions")
def deployment_versions(request: Request, name: DeploymentName, db: Db, who: Viewer):
    """The caller's own deployment's versions, split over time and rollout actions (as
    GET /api/v1/deployments/NAME/history: another tenant's is a 404)."""
    return page(request, "deployment", who, **deployment_view(db, who, name))


@router.get("/usage")
def usage(
    request: Request,
    db: Db,
    who: Viewer,
    days: Annotated[float, Query(gt=0, le=3660)] = 30,
    tenant: TenantFilter = None,
):
    scope = _scope(db, who, tenant)
    report = accounting.report(db, who, scope["tenant"], time.time() - days * 86400)
    quotas = {t.name: t.quotas for t in tenants.list_(db, who)}
    return page(request, "usage", who, report=report, days=days, quotas=quotas, **scope)


@router.get("/usage/month")
def usage_month(db: Db, who: Viewer, tenant: TenantFilter = None):
    """This month's GPU-hours and cost per tenant, day by day, with quotas and budgets."""
    return JSONResponse(usage_series.month(db, who, tenant or None, time.time()))


@router.get("/simulator")
def simulator_page(request: Request, who: Viewer):
    return page(
        request,
        "simulator",
        who,
        examples=simulator.EXAMPLES,
        policies=simulator.policy_names(),
        chosen=simulator.DEFAULT_POLICIES,
    )


def deployments_view(db: Session, who: Principal, tenant: str | None = None) -> dict:
    """What the deployments page and its scale action show."""
    scope = _scope(db, who, tenant)
    return {"deployments": deployments.list_of(db, scope["tenant_ids"]), **scope}


def deployment_view(db: Session, who: Principal, name: str) -> dict:
    """What a deployment's versions page and its rollout actions show."""
    history = deployment_routes.history(name, db, who)
    return {
        "dep": deployment_routes.get(name, db, who),
        "history": history,
        "split": views.traffic_split(history, time.time()),
    }
