"""/api/v1/usage and /api/v1/usage/showback."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from gpucloud.control import accounting
from gpucloud.control.deps import Caller, Db
from gpucloud.control.finops_schemas import Showback
from gpucloud.control.schemas import UsageReport
from gpucloud.control.services import showback as showback_service

router = APIRouter(tags=["usage"])
Since = Annotated[float | None, Query(ge=0, le=1e11, description="epoch seconds")]
TenantName = Annotated[str | None, Query(max_length=63)]


@router.get("/usage", response_model=UsageReport)
def usage(db: Db, who: Caller, tenant: TenantName = None, since: Since = None) -> UsageReport:
    return accounting.report(db, who, tenant, since)


@router.get("/usage/showback", response_model=Showback)
def showback(
    db: Db,
    who: Caller,
    by: Annotated[
        str, Query(max_length=200, description=f"comma-separated: {showback_service.ALLOWED}")
    ] = "tenant",
    tenant: TenantName = None,
    since: Since = None,
) -> Showback:
    """GPU-hours held and asked for, and cost, grouped by the `by` dimensions."""
    return showback_service.showback(db, who, showback_service.parse_by(by), since, tenant)
