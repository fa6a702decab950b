"""OpenAI's Batch API objects: a tenant's batches, made from one of its input files (every
line checked first), listed, cancelled, and shown as OpenAI's Batch object. Running them
is batch_runner.py's work."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.control import batch_input
from gpucloud.control.auth import Principal
from gpucloud.control.config import Settings
from gpucloud.control.db import Store
from gpucloud.control.errors import ConflictError
from gpucloud.control.lifecycle import BATCH_TRANSITIONS, BatchStatus, Role
from gpucloud.control.models import Batch
from gpucloud.control.services import audit, batch_files
from gpucloud.errors import UserError

WINDOWS = {"24h": 24 * 3600.0}  # completion windows: seconds a batch may run


class BatchCreate(BaseModel):
    """The body of POST /v1/batches (fields OpenAI adds later are ignored)."""

    model_config = ConfigDict(extra="ignore")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def create(store: Store, settings: Settings, who: Principal, body: Any) -> Batch:
    """A new batch of `who`'s tenant (status validating: the runner starts it). Its input
    file is read and checked here, outside any transaction. Raises UserError (a bad field,
    a line at fault), NotFoundError (no such input file)."""
    who.require(Role.MEMBER)
    spec = _spec(body)
    with store.reading() as s:
        source = batch_files.get(s, who, spec.input_file_id)
    if source.purpose != batch_files.INPUT:
        raise UserError(
            f"file {source.id!r} has purpose {source.purpose!r}: "
            "a batch reads a file uploaded with purpose 'batch'"
        )
    data = batch_files.path(settings, source).read_bytes()
    lines = batch_input.parse(data, spec.endpoint)
    now = time.time()
    batch = Batch(id=batch_files.new_id("batch_"), tenant_id=who.tenant_id, user_id=who.user_id,
                  endpoint=spec.endpoint, input_file_id=source.id,
                  completion_window=spec.completion_window, status=BatchStatus.VALIDATING,
                  metadata_=spec.metadata, total=len(lines), completed=0, failed=0,
                  created_at=now, expires_at=now + WINDOWS[spec.completion_window])  # fmt: skip
    with store.transaction() as s:
        s.add(batch)
        audit.record(s, who, "batch.create", batch.id, lines=len(lines), endpoint=spec.endpoint)
    return batch


def _spec(body: Any) -> BatchCreate:
    try:
        spec = BatchCreate.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise UserError(f"{where}: {first['msg']}") from None
    if spec.endpoint not in batch_input.ENDPOINTS:
        raise UserError(
            f"endpoint must be one of {', '.join(batch_input.ENDPOINTS)} (got {spec.endpoint!r})"
        )
    if spec.completion_window not in WINDOWS:
        raise UserError(
            f"completion_window must be one of {', '.join(WINDOWS)} "
            f"(got {spec.completion_window!r})"
        )
    if spec.metadata is not None and len(spec.metadata) > 16:
        raise UserError("metadata holds at most 16 keys")
    return spec


def get(session: Session, who: Principal, batch_id: str) -> Batch:
    """`who`'s tenant's batch. Raises NotFoundError (also for another tenant's)."""
    return batch_files.owned(session, who, Batch, batch_id, "batch")


def list_(
    session: Session, who: Principal, after: str | None, limit: int
) -> tuple[list[Batch], bool]:
    """Up to `limit` of the tenant's batches, newest first, after the batch `after`; and
    whether more follow."""
    query = select(Batch).where(Batch.tenant_id == who.tenant_id)
    if after:
        cursor = get(session, who, after)
        query = query.where(
            (Batch.created_at < cursor.created_at)
            | ((Batch.created_at == cursor.created_at) & (Batch.id < cursor.id))
        )
    found = list(
        session.scalars(query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1))
    )
    return found[:limit], len(found) > limit


def cancel(session: Session, who: Principal, batch_id: str) -> Batch:
    """Ask the runner to stop `batch_id`: lines in flight finish, no new one starts.
    Raises UserError once it is finished."""
    who.require(Role.MEMBER)
    batch = get(session, who, batch_id)
    if batch.status == BatchStatus.CANCELLING:
        return batch
    move(batch, BatchStatus.CANCELLING)
    audit.record(session, who, "batch.cancel", batch.id)
    return batch


def move(batch: Batch, to: BatchStatus) -> None:
    """Set `batch`'s status and the time it entered it. Raises UserError if its status
    may not go there (ConflictError)."""
    if to not in BATCH_TRANSITIONS[BatchStatus(batch.status)]:
        raise ConflictError(f"batch {batch.id} is {batch.status}: it cannot become {to}")
    batch.status = to
    setattr(batch, f"{to}_at", time.time())


def public(batch: Batch) -> dict:
    """The batch as OpenAI's Batch object."""
    stamps = ("created_at", "expires_at", "in_progress_at", "finalizing_at", "completed_at",
              "failed_at", "expired_at", "cancelling_at", "cancelled_at")  # fmt: skip
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        **{k: None if getattr(batch, k) is None else int(getattr(batch, k)) for k in stamps},
        "request_counts": {
            "total": batch.total,
            "completed": batch.completed,
            "failed": batch.failed,
        },
        "metadata": batch.metadata_,
    }
