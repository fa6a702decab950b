"""OpenAI's Files API for batches: a tenant's files, their rows in the store and their
bytes under the control plane's home (HOME/batch-files/<tenant id>/<file id>, which no
workload sees). A file of another tenant is answered like one that does not exist."""

from __future__ import annotations

import contextlib
import secrets
import time
from pathlib import Path
from typing import TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.control.auth import Principal
from gpucloud.control.config import Settings
from gpucloud.control.db import Store
from gpucloud.control.errors import ConflictError
from gpucloud.control.lifecycle import BATCH_RUNNING, Role
from gpucloud.control.models import Batch, BatchFile
from gpucloud.errors import NotFoundError, UserError

T = TypeVar("T", BatchFile, Batch)
INPUT, OUTPUT = "batch", "batch_output"  # purposes: what a tenant uploads, what batches write


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def staging_path(settings: Settings, tenant_id: int) -> Path:
    """A new path to write an upload to, in the tenant's dir (made if missing)."""
    folder = settings.home / "batch-files" / str(tenant_id)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder / (new_id("upload-") + ".part")


def path(settings: Settings, f: BatchFile) -> Path:
    return settings.home / "batch-files" / str(f.tenant_id) / f.id


def add(store: Store, settings: Settings, who: Principal, staged: Path, filename: str,
        purpose: str) -> BatchFile:  # fmt: skip
    """Keep the upload at `staged` as a new file of `who`'s tenant. Raises UserError for
    a purpose other than batch."""
    who.require(Role.MEMBER)
    if purpose != INPUT:
        raise UserError(
            f"purpose must be {INPUT!r} (got {purpose!r}): files here are Batch API inputs"
        )
    with store.transaction() as s:
        return keep(s, settings, who.tenant_id, staged, filename, purpose)


def keep(session: Session, settings: Settings, tenant_id: int, staged: Path, filename: str,
         purpose: str) -> BatchFile:  # fmt: skip
    """Move `staged` (in the tenant's dir) to its file's path and add its row."""
    f = BatchFile(id=new_id("file-"), tenant_id=tenant_id, filename=filename[:255],
                  purpose=purpose, bytes=staged.stat().st_size, created_at=time.time())  # fmt: skip
    staged.rename(path(settings, f))
    session.add(f)
    return f


def get(session: Session, who: Principal, file_id: str) -> BatchFile:
    return owned(session, who, BatchFile, file_id, "file")


def owned(session: Session, who: Principal, table: type[T], row_id: str, kind: str) -> T:
    """`who`'s tenant's row `row_id` of `table` (a `kind`). Raises NotFoundError, also for
    another tenant's: its existence is not theirs to learn."""
    row = session.get(table, row_id)
    if row is None or row.tenant_id != who.tenant_id:
        raise NotFoundError(f"no {kind} {row_id!r} in tenant {who.tenant_name}")
    return row


def list_(session: Session, who: Principal, purpose: str | None) -> list[BatchFile]:
    query = select(BatchFile).where(BatchFile.tenant_id == who.tenant_id)
    if purpose:
        query = query.where(BatchFile.purpose == purpose)
    return list(session.scalars(query.order_by(BatchFile.created_at.desc())))


def delete(store: Store, settings: Settings, who: Principal, file_id: str) -> None:
    """Delete a file and its bytes. Raises ConflictError while an unfinished batch reads it."""
    who.require(Role.MEMBER)
    with store.transaction() as s:
        f = get(s, who, file_id)
        reader = s.scalar(
            select(Batch.id).where(Batch.input_file_id == f.id, Batch.status.in_(BATCH_RUNNING))
        )
        if reader is not None:
            raise ConflictError(
                f"file {file_id!r} is the input of batch {reader}, which is not finished: "
                "cancel it first"
            )
        s.delete(f)
    with contextlib.suppress(FileNotFoundError):
        path(settings, f).unlink()


def public(f: BatchFile) -> dict:
    """The file as OpenAI's File object."""
    return {"id": f.id, "object": "file", "bytes": f.bytes, "created_at": int(f.created_at),
            "filename": f.filename, "purpose": f.purpose, "status": "processed"}  # fmt: skip
