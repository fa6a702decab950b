"""/api/v1/usage."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from gpucloud.control import accounting
from gpucloud.control.deps import Caller, Db
from gpucloud.control.schemas import UsageReport

router = APIRouter(tags=["usage"])


@router.get("/usage", response_model=UsageReport)
def usage(
    db: Db,
    who: Caller,
    tenant: Annotated[str | None, Query(max_length=63)] = None,
    since: Annotated[float | None, Query(ge=0, le=1e11, description="epoch seconds")] = None,
) -> UsageReport:
    return accounting.report(db, who, tenant, since)
