"""/api/v1/prices."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from gpucloud.control.deps import Caller, Db
from gpucloud.control.finops_schemas import PricePublic, PriceSet
from gpucloud.control.services import prices as service

router = APIRouter(tags=["prices"])


@router.post("/prices", response_model=PricePublic, status_code=201)
def set_price(spec: PriceSet, db: Db, who: Caller) -> PricePublic:
    """Add a price version (operators only): from its date on, usage costs this much."""
    return service.set_(db, who, spec)


@router.get("/prices", response_model=list[PricePublic])
def list_prices(
    db: Db, _who: Caller, gpu_type: Annotated[str | None, Query(max_length=64)] = None
) -> list[PricePublic]:
    """Every price version; types without one cost their catalog price."""
    return service.list_(db, gpu_type)
