"""Budgets: a tenant's (or one user's, or one label's) allowance per calendar month (UTC),
in GPU-hours or USD at the price book's prices.

Past its soft fraction a budget warns (in every submit's response, and as the
gpucloud_budget_* metrics the shipped alert rules read); once spent it holds the new jobs
and the replicas it covers in the queue, scale-ups and restarts alike ("budget exhausted:
..."), and with on_exhausted "stop" the reconciler stops its running jobs too. Each
crossing (soft, spent) is audited once a month. The forecast is the date the budget runs
out if the work running now keeps running.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from gpucloud.control import accounting
from gpucloud.control.accounting import Interval
from gpucloud.control.auth import Principal
from gpucloud.control.db import memo
from gpucloud.control.finops_schemas import UNIT_NAMES, BudgetSet, BudgetStatus
from gpucloud.control.lifecycle import JobState, ReplicaState
from gpucloud.control.models import Budget, Job, Replica, Tenant, User
from gpucloud.control.price_book import PriceBook
from gpucloud.control.services import audit, prices
from gpucloud.control.services import tenants as tenant_service
from gpucloud.errors import NotFoundError

EXHAUSTED = "budget exhausted"
SOFT_CROSSED, SPENT = "budget.soft_crossed", "budget.exhausted"  # audit actions


def month_bounds(now: float) -> tuple[float, float]:
    """The start and end (epoch seconds) of the calendar month (UTC) holding `now`."""
    t = datetime.fromtimestamp(now, UTC)
    start = t.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = start.replace(year=start.year + start.month // 12, month=start.month % 12 + 1)
    return start.timestamp(), end.timestamp()


def covers(b: Budget, tenant_id: int, user: str, labels: dict[str, str]) -> bool:
    """Whether work of `tenant_id`'s `user` with `labels` counts against `b`."""
    if b.tenant_id != tenant_id or (b.user and b.user != user):
        return False
    key, _, value = b.label.partition("=")
    return not b.label or labels.get(key) == value


@dataclass(frozen=True)
class Evaluated:
    budget: Budget
    status: BudgetStatus

    def describe(self) -> str:
        s, unit = self.status, UNIT_NAMES[self.status.unit]
        scope = f"tenant {s.tenant}" + (f" user {s.user}" if s.user else "")
        scope += f" label {s.label}" if s.label else ""
        return f"{scope} used {s.spent:.4g} of {s.amount:g} {unit} in {s.month}"


def evaluate(
    session: Session, now: float, tenant_ids: Iterable[int] | None = None
) -> list[Evaluated]:
    """Every budget (of `tenant_ids` if given) with what it has spent this month."""
    q = select(Budget, Tenant.name).join(Tenant, Budget.tenant_id == Tenant.id).order_by(Budget.id)
    if tenant_ids is not None:
        if not _budgeted(session).intersection(tenant_ids):
            return []  # most submissions: no budget to evaluate, nothing to read
        q = q.where(Budget.tenant_id.in_(list(tenant_ids)))
    rows = session.execute(q).all()
    if not rows:
        return []
    start, end = month_bounds(now)
    ivs = accounting.intervals(session, start, now, {b.tenant_id for b, _ in rows})
    book = prices.book(session)
    return [Evaluated(b, _status(b, name, ivs, book, now, end)) for b, name in rows]


def _budgeted(session: Session) -> set[int]:
    """The tenants with budgets (kept by db.memo until a budget changes)."""
    read = lambda: set(session.scalars(select(Budget.tenant_id).distinct()))  # noqa: E731
    return memo(session, "budgeted tenants", (Budget,), None, read)


def _status(
    b: Budget, tenant: str, ivs: list[Interval], book: PriceBook, now: float, month_end: float
) -> BudgetStatus:
    mine = [iv for iv in ivs if covers(b, iv.tenant_id, iv.user, iv.labels)]
    if b.unit == "usd":
        spent = sum(iv.cost(book) for iv in mine)
        burn = sum(iv.gpus * book.per_hour(iv.gpu_type, iv.node, now) for iv in mine if iv.open)
    else:
        spent = sum(iv.gpu_hours for iv in mine)
        burn = float(sum(iv.gpus for iv in mine if iv.open))
    fraction = spent / b.amount
    runs_out = now + (b.amount - spent) / burn * 3600 if burn > 0 and spent < b.amount else None
    return BudgetStatus(
        tenant=tenant,
        user=b.user,
        label=b.label,
        unit=b.unit,
        amount=b.amount,
        soft=b.soft,
        on_exhausted=b.on_exhausted,
        month=datetime.fromtimestamp(now, UTC).strftime("%Y-%m"),
        spent=spent,
        fraction=fraction,
        state="exhausted" if fraction >= 1 else "warning" if fraction >= b.soft else "ok",
        burn_per_hour=burn,
        runs_out_at=runs_out if runs_out is not None and runs_out < month_end else None,
    )


def warnings(
    session: Session, submits: list[tuple[Principal, dict[str, str]]], now: float
) -> list[list[str]]:
    """What each submit (its caller, its job's labels) is told: every budget covering it
    that is past its soft fraction or spent. One evaluation for the whole batch."""
    evaluated = evaluate(session, now, {who.tenant_id for who, _ in submits})
    return [_warnings(evaluated, who, labels) for who, labels in submits]


def _warnings(evaluated: list[Evaluated], who: Principal, labels: dict[str, str]) -> list[str]:
    out = []
    for e in evaluated:
        if e.status.state == "ok" or not covers(e.budget, who.tenant_id, who.user_name, labels):
            continue
        if e.status.state == "exhausted":
            out.append(f"{EXHAUSTED}: {e.describe()}; the job waits until it is raised")
        else:
            out.append(f"budget past {e.status.soft:.0%}: {e.describe()}{_forecast(e.status)}")
    return out


def stop(session: Session, reasons: dict[int, str]) -> None:
    """Have the reconciler stop these running jobs (job id -> why: its budget is spent and
    says so); each ends CANCELLED with its reason."""
    for job in session.scalars(select(Job).where(Job.id.in_(list(reasons)))):
        if job.state == JobState.RUNNING and not job.cancel_requested:
            job.cancel_requested = True
            job.stop_reason = reasons[job.id]
            audit.record(session, None, "budget.stop", f"job/{job.id}", tenant_id=job.tenant_id,
                         reason=reasons[job.id])  # fmt: skip


def explain_held_replicas(session: Session, held: dict[int, str]) -> None:
    """Give each pending replica a spent budget holds (replica id -> why) that reason: a
    restart held, or a scale-up, says why it waits instead of its last exit."""
    stale = [
        {"rid": rid, "why": held[rid]}
        for rid, reason in session.execute(
            select(Replica.id, Replica.reason).where(
                Replica.id.in_(list(held)), Replica.state == ReplicaState.PENDING
            )
        )
        if reason != held[rid]
    ]
    if stale:
        session.connection().execute(
            update(Replica).where(Replica.id == bindparam("rid")).values(reason=bindparam("why")),
            stale,
        )


@dataclass(frozen=True)
class Crossing:
    """A budget past a threshold (its soft fraction, or spent) in a month not audited yet."""

    budget_id: int
    tenant_id: int
    action: str  # SOFT_CROSSED | SPENT
    month: str
    target: str
    text: str


def crossings(evaluated: list[Evaluated]) -> list[Crossing]:
    """The crossings among `evaluated` whose month has no audit entry for them yet."""
    out = []
    for e in evaluated:
        s, b = e.status, e.budget
        target = _target(s.tenant, s.user, s.label)
        if s.fraction >= s.soft and b.soft_audited != s.month:
            out.append(Crossing(b.id, b.tenant_id, SOFT_CROSSED, s.month, target, e.describe()))
        if s.fraction >= 1 and b.exhausted_audited != s.month:
            out.append(Crossing(b.id, b.tenant_id, SPENT, s.month, target, e.describe()))
    return out


def audit_crossings(session: Session, found: list[Crossing]) -> None:
    """Audit each crossing, once per budget and month (one audited since is skipped)."""
    for c in found:
        b = session.get(Budget, c.budget_id)
        column = "soft_audited" if c.action == SOFT_CROSSED else "exhausted_audited"
        if b is None or getattr(b, column) == c.month:
            continue
        setattr(b, column, c.month)
        audit.record(session, None, c.action, c.target, tenant_id=c.tenant_id, month=c.month,
                     status=c.text)  # fmt: skip


def _forecast(s: BudgetStatus) -> str:
    if s.runs_out_at is None:
        return ""
    at = datetime.fromtimestamp(s.runs_out_at, UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"; runs out about {at} at the current burn rate"


def set_(session: Session, who: Principal, tenant: str, spec: BudgetSet) -> BudgetStatus:
    """Set (or replace) `tenant`'s budget for spec's user and label (operators only)."""
    who.require_operator()
    t = tenant_service.get(session, who, tenant)
    if (
        spec.user
        and session.scalar(select(User.id).where(User.tenant_id == t.id, User.name == spec.user))
        is None
    ):
        raise NotFoundError(f"tenant {tenant!r} has no user {spec.user!r}")
    b = _find(session, t.id, spec.user, spec.label)
    if b is None:
        b = Budget(tenant_id=t.id, user=spec.user, label=spec.label, created_at=time.time())
        session.add(b)
    b.unit, b.amount, b.soft, b.on_exhausted = spec.unit, spec.amount, spec.soft, spec.on_exhausted
    audit.record(session, who, "budget.set", _target(tenant, spec.user, spec.label),
                 tenant_id=t.id, **spec.model_dump(exclude={"user", "label"}))  # fmt: skip
    session.flush()
    return next(e.status for e in evaluate(session, time.time(), [t.id]) if e.budget.id == b.id)


def delete(session: Session, who: Principal, tenant: str, user: str, label: str) -> BudgetStatus:
    """Remove a budget (operators only); returns it as it stood. Raises NotFoundError if
    there is none."""
    who.require_operator()
    t = tenant_service.get(session, who, tenant)
    b = _find(session, t.id, user, label)
    if b is None:
        raise NotFoundError(f"no budget of {_target(tenant, user, label)}")
    status = next(e.status for e in evaluate(session, time.time(), [t.id]) if e.budget.id == b.id)
    session.delete(b)
    audit.record(session, who, "budget.delete", _target(tenant, user, label), tenant_id=t.id)
    return status


def list_(session: Session, who: Principal, tenant: str | None = None) -> list[BudgetStatus]:
    """The budgets of the caller's tenant (an operator: every tenant's, or the one named)."""
    ids = accounting.visible_tenants(session, who, tenant)
    return [e.status for e in evaluate(session, time.time(), ids)]


def _find(session: Session, tenant_id: int, user: str, label: str) -> Budget | None:
    return session.scalar(
        select(Budget).where(
            Budget.tenant_id == tenant_id, Budget.user == user, Budget.label == label
        )
    )


def _target(tenant: str, user: str, label: str) -> str:
    return f"budget/{tenant}" + (f"/user={user}" if user else "") + (f"/{label}" if label else "")
