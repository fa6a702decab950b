"""/api/v1/jobs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from gpucloud.control import logs, tenancy, workloads
from gpucloud.control.deps import Caller, Db, StoreDep, Wake
from gpucloud.control.executors.base import WorkloadRef
from gpucloud.control.lifecycle import FINISHED, JobState
from gpucloud.control.models import Job
from gpucloud.control.schemas import JobPublic, JobSpec
from gpucloud.control.services import jobs as service
from gpucloud.errors import NotFoundError

router = APIRouter(tags=["jobs"])
JobId = Annotated[int, Path(ge=1, le=2**31 - 1)]  # PostgreSQL INTEGER


@router.post("/jobs", response_model=JobPublic, status_code=201, dependencies=[Wake])
async def submit(spec: JobSpec, who: Caller, request: Request) -> JobPublic:
    """Queued with the submissions that arrive meanwhile, in one transaction (GroupCommit):
    no worker thread or transaction of its own."""
    settings = request.app.state.settings
    workdir = tenancy.resolve(settings, who.tenant_name, spec.workdir, "workdir")
    checkpoint_dir = tenancy.resolve(
        settings, who.tenant_name, spec.checkpoint_dir, "checkpoint_dir", start=workdir, urls=True
    )
    paths = {"workdir": workdir, "checkpoint_dir": checkpoint_dir}
    return await request.app.state.job_submissions((who, spec.model_copy(update=paths)))


@router.get("/jobs", response_model=list[JobPublic])
def list_jobs(
    db: Db,
    who: Caller,
    state: JobState | None = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
) -> list[JobPublic]:
    return service.list_(db, who, state, limit)


@router.get("/jobs/{job_id}", response_model=JobPublic)
def get(job_id: JobId, db: Db, who: Caller) -> JobPublic:
    return service.public(db, service.get(db, who, job_id), who.tenant_name)


@router.post("/jobs/{job_id}/cancel", response_model=JobPublic, dependencies=[Wake])
def cancel(job_id: JobId, db: Db, who: Caller) -> JobPublic:
    return service.cancel(db, who, job_id)


@router.get("/jobs/{job_id}/logs", response_class=PlainTextResponse)
def job_logs(
    request: Request,
    job_id: JobId,
    db: Db,
    who: Caller,
    store: StoreDep,
    follow: bool = False,
    tail: Annotated[int | None, Query(ge=0, le=2**31, description="last N bytes")] = None,
):
    """The job's output (all attempts); `follow=true` streams it until the job ends."""
    service.get(db, who, job_id)  # 404 for another tenant's job
    path = request.app.state.settings.log_path(WorkloadRef.job(job_id))
    if not follow:
        return PlainTextResponse(logs.read(path).decode(errors="replace"))

    def finished() -> bool:
        with store.reading() as s:
            return s.get(Job, job_id).state in FINISHED

    return StreamingResponse(logs.follow(path, finished), media_type="text/plain")


@router.get("/jobs/{job_id}/metrics", response_class=PlainTextResponse)
def job_metrics(
    request: Request,
    job_id: JobId,
    db: Db,
    who: Caller,
) -> PlainTextResponse:
    """The run's metrics.jsonl, one JSON record per logged step (`gpucloud doctor --job`): a
    training job's, or a command job's in its checkpoint dir."""
    job = service.get(db, who, job_id)
    run_dir = workloads.job_run_dir(request.app.state.settings, job, who.tenant_name)
    if run_dir is None:
        raise NotFoundError(f"job {job_id} keeps no metrics: a command job needs a checkpoint_dir")
    path = run_dir / "metrics.jsonl"  # gpucloud.train.metrics.METRICS_FILE
    if not path.is_file():
        raise NotFoundError(f"job {job_id} has written no metrics yet ({path.name})")
    return PlainTextResponse(logs.read(path).decode(errors="replace"))
