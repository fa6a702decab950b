"""Prices per GPU type and pool: versions an operator adds, and the book that applies them."""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.control.auth import Principal
from gpucloud.control.errors import ConflictError
from gpucloud.control.finops_schemas import PricePublic, PriceSet
from gpucloud.control.models import Node, Price
from gpucloud.control.price_book import PriceBook
from gpucloud.control.services import audit
from gpucloud.errors import UserError

# A version may start this much before the request arrives (clocks differ by a little).
PAST_SLACK = 60.0


def set_(session: Session, who: Principal, spec: PriceSet) -> PricePublic:
    """Add a price version (operators only). Raises UserError for a date in the past: usage
    already recorded keeps the price it had."""
    who.require_operator()
    now = time.time()
    start = now if spec.effective_from is None else spec.effective_from
    if start < now - PAST_SLACK:
        raise UserError(
            f"effective_from {start:.0f} is in the past: a price applies from now or a later "
            "date (usage already recorded keeps its price)"
        )
    same = select(Price.id).where(
        Price.gpu_type == spec.gpu_type, Price.pool == spec.pool, Price.effective_from == start
    )
    if session.scalar(same) is not None:
        raise ConflictError(f"a price of {spec.gpu_type} {spec.pool!r} starts at {start} already")
    price = Price(
        gpu_type=spec.gpu_type,
        pool=spec.pool,
        per_hour=spec.per_hour,
        effective_from=start,
        created_at=now,
    )
    session.add(price)
    target = f"price/{spec.gpu_type}" + (f"/{spec.pool}" if spec.pool else "")
    audit.record(session, who, "price.set", target, per_hour=spec.per_hour, effective_from=start)
    session.flush()
    versions = list_(session, spec.gpu_type)
    return next(p for p in versions if (p.pool, p.effective_from) == (spec.pool, start))


def list_(session: Session, gpu_type: str | None = None) -> list[PricePublic]:
    """Every version, by type, pool and date, each with the date the next one takes over."""
    q = select(Price).order_by(Price.gpu_type, Price.pool, Price.effective_from)
    if gpu_type is not None:
        q = q.where(Price.gpu_type == gpu_type)
    rows = session.scalars(q).all()
    out = []
    for p, nxt in zip(rows, [*rows[1:], None], strict=False):
        same_series = nxt is not None and (nxt.gpu_type, nxt.pool) == (p.gpu_type, p.pool)
        out.append(
            PricePublic(
                gpu_type=p.gpu_type,
                pool=p.pool,
                per_hour=p.per_hour,
                effective_from=p.effective_from,
                effective_until=nxt.effective_from if same_series else None,
                created_at=p.created_at,
            )
        )
    return out


def book(session: Session) -> PriceBook:
    """Every price version and every node's labels, to price usage with."""
    prices = PriceBook(node_labels=dict(session.execute(select(Node.name, Node.labels)).all()))
    for p in session.scalars(select(Price)):
        prices.add(p.gpu_type, p.pool, p.effective_from, p.per_hour)
    return prices
