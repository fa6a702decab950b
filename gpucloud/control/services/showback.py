"""Showback: GPU-hours held and asked for, and their cost, grouped by any of tenant, user,
label (all of a job's or a deployment's labels, or one key's value: label:team), GPU type
and node."""

from __future__ import annotations

import time
from collections.abc import Callable

from sqlalchemy.orm import Session

from gpucloud.control import accounting
from gpucloud.control.accounting import Interval
from gpucloud.control.auth import Principal
from gpucloud.control.finops_schemas import Showback, ShowbackRow
from gpucloud.control.services import prices
from gpucloud.errors import UserError

_DIMENSIONS: dict[str, Callable[[Interval], str]] = {
    "tenant": lambda iv: iv.tenant,
    "user": lambda iv: iv.user or "-",
    "label": lambda iv: accounting.label_text(iv.labels),
    "gpu_type": lambda iv: iv.gpu_type,
    "node": lambda iv: iv.node or "-",
    "kind": lambda iv: iv.kind,
}
ALLOWED = "tenant, user, label, label:KEY, gpu_type, node, kind"


def parse_by(text: str) -> list[str]:
    """'tenant,label:team' -> ['tenant', 'label:team']. Raises UserError naming a bad one."""
    dims = [d.strip() for d in text.split(",") if d.strip()]
    for d in dims:
        if d not in _DIMENSIONS and not (d.startswith("label:") and len(d) > len("label:")):
            raise UserError(f"--by {d!r} is not a dimension: use a list of {ALLOWED}")
    if not dims:
        raise UserError(f"--by is empty: use a list of {ALLOWED}")
    return dims


def _value(iv: Interval, dim: str) -> str:
    if dim.startswith("label:"):
        return str(iv.labels.get(dim.removeprefix("label:"), "-"))
    return _DIMENSIONS[dim](iv)


def showback(
    session: Session, who: Principal, by: list[str], since: float | None, tenant: str | None
) -> Showback:
    """Rows of usage grouped by `by`, biggest cost first; the caller's tenant only unless
    it is an operator."""
    until = time.time()
    book = prices.book(session)
    rows: dict[tuple[str, ...], ShowbackRow] = {}
    for iv in accounting.intervals(
        session, since, until, accounting.visible_tenants(session, who, tenant)
    ):
        key = tuple(_value(iv, d) for d in by)
        row = rows.setdefault(
            key,
            ShowbackRow(group=dict(zip(by, key, strict=True)), gpu_hours=0.0,
                        requested_gpu_hours=0.0, waste_gpu_hours=0.0, cost=0.0),
        )  # fmt: skip
        row.gpu_hours += iv.gpu_hours
        row.requested_gpu_hours += iv.requested_gpu_hours
        row.waste_gpu_hours += iv.requested_gpu_hours - iv.gpu_hours
        row.cost += iv.cost(book)
    ordered = sorted(rows.values(), key=lambda r: (-r.cost, tuple(r.group.values())))
    return Showback(since=since, until=until, by=by, rows=ordered)
