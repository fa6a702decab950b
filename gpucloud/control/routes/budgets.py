"""/api/v1/budgets and /api/v1/tenants/{name}/budgets."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from gpucloud.control.deps import Caller, Db
from gpucloud.control.finops_schemas import BudgetSet, BudgetStatus, LabelSelector
from gpucloud.control.services import budgets as service

router = APIRouter(tags=["budgets"])
TenantName = Annotated[str, Path(max_length=63)]


@router.put("/tenants/{name}/budgets", response_model=BudgetStatus)
def set_budget(name: TenantName, spec: BudgetSet, db: Db, who: Caller) -> BudgetStatus:
    """Set a monthly budget of tenant NAME, or of one of its users or job labels (operators)."""
    return service.set_(db, who, name, spec)


@router.delete("/tenants/{name}/budgets", response_model=BudgetStatus)
def delete_budget(
    name: TenantName,
    db: Db,
    who: Caller,
    user: Annotated[str, Query(max_length=63)] = "",
    label: Annotated[LabelSelector, Query()] = "",
) -> BudgetStatus:
    """Remove a budget (operators); returns it as it stood."""
    return service.delete(db, who, name, user, label)


@router.get("/budgets", response_model=list[BudgetStatus])
def list_budgets(
    db: Db, who: Caller, tenant: Annotated[str | None, Query(max_length=63)] = None
) -> list[BudgetStatus]:
    """This month's budgets: spent, state, burn rate and when each runs out at that rate."""
    return service.list_(db, who, tenant)
