"""/api/v1/uploads: a directory for the caller's tenant, sent as a gzipped tar, unpacked into
its area (see gpucloud.control.uploads). The body is streamed to disk, never held whole."""

from __future__ import annotations

import os
import tempfile

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel

from gpucloud.control import tenancy, uploads
from gpucloud.control.deps import Caller
from gpucloud.control.lifecycle import Role
from gpucloud.errors import TooLargeError

router = APIRouter(tags=["uploads"])


class UploadPublic(BaseModel):
    path: str  # where it was unpacked: a workdir or model dir for the tenant's workloads
    files: int
    bytes: int


@router.post(
    "/uploads",
    response_model=UploadPublic,
    status_code=201,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
        }
    },
)
async def upload(request: Request, who: Caller) -> UploadPublic:
    who.require(Role.MEMBER)
    settings = request.app.state.settings
    limit = settings.max_upload_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise TooLargeError(_too_large(limit))
    staging = settings.home / "staging"
    staging.mkdir(mode=0o700, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=staging, suffix=".tar.gz")
    try:
        with os.fdopen(fd, "wb") as out:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise TooLargeError(_too_large(limit))
                out.write(chunk)
        done = await run_in_threadpool(_unpack, settings, who, name, limit)
    finally:
        os.unlink(name)
    return UploadPublic(path=str(done.path), files=done.files, bytes=done.bytes)


def _unpack(settings, who, archive: str, limit: int) -> uploads.Unpacked:
    identity = tenancy.identity(settings, who.tenant_id)
    area = tenancy.prepare_area(settings, who.tenant_name, identity)
    return uploads.unpack(archive, settings.home / "staging", area, identity, limit)


def _too_large(limit: int) -> str:
    return (
        f"upload too large: the limit is {limit} bytes (gpucloud up --max-upload-bytes); "
        "put large data in a directory the admin exports (--export) instead"
    )
