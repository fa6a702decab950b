"""OpenAI's Files and Batch API on the control plane: /v1/files and /v1/batches, for the
real `openai` client (`client.files.create(purpose="batch")`, `client.batches.create`).
Errors have OpenAI's shape (app.py maps them for every /v1 path)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse

from gpucloud.control import multipart
from gpucloud.control.deps import Caller, Db, after_commit
from gpucloud.control.services import batch_files, batches
from gpucloud.errors import TooLargeError, UserError
from gpucloud.http_body import PARSED

router = APIRouter(prefix="/v1", tags=["OpenAI Batch API"])
FileId = Annotated[str, Path(max_length=40)]
BatchId = Annotated[str, Path(max_length=40)]
FORM_OVERHEAD = 64 << 10  # bytes a form may hold besides its file (boundaries, fields)


@router.post("/files")
async def create_file(request: Request, who: Caller) -> dict:
    """Upload a JSONL file (multipart form: `file`, and `purpose` = batch), at most the
    control plane's upload limit (gpucloud up --max-upload-bytes)."""
    settings = request.app.state.settings
    limit = settings.max_upload_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + FORM_OVERHEAD:
        raise TooLargeError(f"file too large: the limit is {limit} bytes")
    staged = await run_in_threadpool(batch_files.staging_path, settings, who.tenant_id)
    try:
        kind = request.headers.get("content-type", "")
        form = await multipart.read(request.stream(), kind, "file", staged, limit)
        if form.filename is None:
            raise UserError("the form has no 'file' part: send the JSONL file as 'file'")
        purpose = form.fields.get("purpose", "")
        f = await run_in_threadpool(batch_files.add, request.app.state.store, settings, who,
                                    staged, form.filename, purpose)  # fmt: skip
    finally:
        staged.unlink(missing_ok=True)  # gone already if kept
    return batch_files.public(f)


@router.get("/files")
def list_files(db: Db, who: Caller, purpose: str | None = None) -> dict:
    data = [batch_files.public(f) for f in batch_files.list_(db, who, purpose)]
    return {"object": "list", "data": data, "has_more": False}


@router.get("/files/{file_id}")
def get_file(file_id: FileId, db: Db, who: Caller) -> dict:
    return batch_files.public(batch_files.get(db, who, file_id))


@router.get("/files/{file_id}/content", response_class=FileResponse)
def file_content(file_id: FileId, request: Request, db: Db, who: Caller) -> FileResponse:
    f = batch_files.get(db, who, file_id)
    path = batch_files.path(request.app.state.settings, f)
    return FileResponse(path, media_type="application/octet-stream", filename=f.filename)


@router.delete("/files/{file_id}")
def delete_file(file_id: FileId, request: Request, who: Caller) -> dict:
    state = request.app.state
    batch_files.delete(state.store, state.settings, who, file_id)
    return {"id": file_id, "object": "file", "deleted": True}


@router.post("/batches")
def create_batch(request: Request, who: Caller) -> dict:
    """Run the requests of an input file (every line checked first: a line at fault is a
    400 naming it) at low priority on the caller's deployments."""
    state = request.app.state
    body = getattr(request.state, PARSED, None)
    batch = batches.create(state.store, state.settings, who, body)
    state.batch_runner.wake()
    return batches.public(batch)


@router.get("/batches")
def list_batches(db: Db, who: Caller, after: str | None = None, limit: int = 20) -> dict:
    if not 1 <= limit <= 100:
        raise UserError(f"limit must be from 1 to 100 (got {limit})")
    found, more = batches.list_(db, who, after, limit)
    data = [batches.public(b) for b in found]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}


@router.get("/batches/{batch_id}")
def get_batch(batch_id: BatchId, db: Db, who: Caller) -> dict:
    return batches.public(batches.get(db, who, batch_id))


@router.post("/batches/{batch_id}/cancel")
def cancel_batch(batch_id: BatchId, request: Request, db: Db, who: Caller) -> dict:
    """Stop a batch: lines in flight finish, the others go to its error file."""
    batch = batches.cancel(db, who, batch_id)
    after_commit(db, request.app.state.batch_runner.wake)
    return batches.public(batch)
