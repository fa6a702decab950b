"""The console's actions (POST): log in and out, submit and cancel a job, scale a deployment,
roll out a new version of one, promote or roll back its canary.

Each calls the API's own route or service function with the caller's principal, so the
same checks refuse the same things. A refusal comes back as a one-line alert fragment,
which htmx shows in the page's alert region (HX-Retarget), with the API's status code.
"""

from __future__ import annotations

import shlex
from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from pydantic import ValidationError
from sqlalchemy.orm import Session

from gpucloud.control.auth import Principal
from gpucloud.control.console import render, session, simulator
from gpucloud.control.console.pages import deployment_view, deployments_view
from gpucloud.control.console.render import PREFIX, alert, form, fragment, page
from gpucloud.control.console.session import Viewer
from gpucloud.control.deps import Db, Wake
from gpucloud.control.errors import AuthError
from gpucloud.control.routes import deployments as deployment_routes
from gpucloud.control.routes import jobs as job_routes
from gpucloud.control.routes.deployments import DeploymentName
from gpucloud.control.routes.jobs import JobId
from gpucloud.control.schemas import JobSpec, RolloutSpec
from gpucloud.control.services import deployments
from gpucloud.control.services import jobs as job_service
from gpucloud.control.specfile import explain
from gpucloud.errors import GpucloudError, UserError

router = APIRouter(prefix=PREFIX, include_in_schema=False)
JOB_FIELDS = ("name", "command", "gpus", "checkpoint_dir")


@router.get("/login")
def login_page(request: Request):
    return page(request, "login", None)


@router.post("/login")
async def login(request: Request, background: BackgroundTasks):
    session.check_origin(request)
    key = (await form(request)).get("key", "").strip()
    try:
        await session.signed_in(request, background, key)
    except AuthError as e:
        return page(request, "login", None, status=401, error=str(e))
    response = RedirectResponse(f"{PREFIX}/", status_code=303)
    session.keep(response, request, key)
    return response


@router.post("/logout")
def logout(request: Request):
    session.check_origin(request)
    response = RedirectResponse(session.LOGIN, status_code=303)
    session.end(response, request)
    return response


@router.post("/jobs", dependencies=[Wake])
async def submit(request: Request, who: Viewer) -> Response:
    fields = {k: v for k, v in (await form(request)).items() if k in JOB_FIELDS and v.strip()}
    try:
        spec = JobSpec.model_validate(fields)
        job = await job_routes.submit(spec, who, request)
    except ValidationError as e:
        return alert(request, explain(e, JobSpec), 400)
    except GpucloudError as e:
        return _refused(request, e)
    return _go(request, f"{PREFIX}/jobs/{job.id}")


@router.post("/jobs/{job_id}/cancel", dependencies=[Wake])
def cancel(request: Request, job_id: JobId, db: Db, who: Viewer) -> Response:
    try:
        job = job_service.cancel(db, who, job_id)
    except GpucloudError as e:
        return _refused(request, e)
    return fragment(request, "job_live.html", who=who, job=job)


@router.post("/deployments/{name}/scale", dependencies=[Wake])
async def scale(
    request: Request, name: Annotated[str, Path(max_length=63)], db: Db, who: Viewer
) -> Response:
    value = (await form(request)).get("replicas", "")
    if not value.isdigit() or int(value) > 256:
        return alert(request, f"replicas must be a whole number from 0 to 256, got {value!r}", 400)
    try:
        deployments.scale(db, who, name, int(value))
    except GpucloudError as e:
        return _refused(request, e)
    shown = deployments_view(db, who, request.query_params.get("tenant"))
    return fragment(request, "deployments_live.html", who=who, **shown)


@router.post("/deployments/{name}/rollout", dependencies=[Wake])
async def rollout(request: Request, name: DeploymentName, db: Db, who: Viewer) -> Response:
    """The rollout form: model dir, canary percent, engine args (as on a command line), an
    optional command, and automatic rollback (a checkbox: its default guard, or none)."""
    fields = await form(request)
    try:
        engine_args = shlex.split(fields.get("engine_args", ""))
    except ValueError as e:
        return alert(request, f"engine_args: {e} (write flags as on a command line)", 400)
    values = {
        "model_dir": fields.get("model_dir", "").strip(),
        "engine_args": engine_args,
        "command": fields.get("command", "").strip() or None,
    }
    if canary := fields.get("canary", "").strip():
        values["canary"] = canary
    if "auto_rollback" not in fields:
        values["guard"] = None
    try:
        spec = RolloutSpec.model_validate(values)
        deployment_routes.rollout(name, spec, db, who)
    except ValidationError as e:
        return alert(request, explain(e, RolloutSpec), 400)
    except GpucloudError as e:
        return _refused(request, e)
    return _versions(request, db, who, name)


@router.post("/deployments/{name}/promote", dependencies=[Wake])
def promote(request: Request, name: DeploymentName, db: Db, who: Viewer) -> Response:
    try:
        deployment_routes.promote(name, db, who)
    except GpucloudError as e:
        return _refused(request, e)
    return _versions(request, db, who, name)


@router.post("/deployments/{name}/rollback", dependencies=[Wake])
def rollback(request: Request, name: DeploymentName, db: Db, who: Viewer) -> Response:
    try:
        deployment_routes.rollback(name, db, who)
    except GpucloudError as e:
        return _refused(request, e)
    return _versions(request, db, who, name)


def _versions(request: Request, db: Session, who: Principal, name: str) -> HTMLResponse:
    """The versions page's live part, after an action changed it."""
    shown = deployment_view(db, who, name)
    return fragment(request, "deployment_live.html", who=who, **shown)


def _refused(request: Request, error: GpucloudError) -> HTMLResponse:
    from gpucloud.control.app import status_of  # the API's one map of errors to statuses

    return alert(request, str(error), status_of(error))


def _go(request: Request, url: str) -> Response:
    """To `url`: htmx follows HX-Redirect, a plain form post a 303."""
    if request.headers.get("hx-request"):
        return Response(headers={"HX-Redirect": url})
    return RedirectResponse(url, status_code=303)


@router.post("/simulator")
async def simulate(
    request: Request,
    who: Viewer,
    policy: Annotated[list[str], Query(max_length=16)] = [],  # noqa: B006 (FastAPI copies it)
    example: Annotated[str, Query(max_length=32)] = "",
    cluster: Annotated[str, Query(max_length=200)] = "",
) -> JSONResponse:
    """Replay the trace in the body (CSV; empty = the example named) under each policy."""
    trace = await render.body(request, simulator.MAX_TRACE_BYTES)
    try:
        result = await run_in_threadpool(simulator.run, trace, example, cluster, policy)
    except UserError as e:
        return JSONResponse({"detail": str(e), "error": type(e).__name__}, status_code=400)
    return JSONResponse(result)
