"""Admission at submit time: could this request ever run here, within its tenant's quota?"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpucloud.control.lifecycle import NodeState
from gpucloud.control.models import Node, Quota
from gpucloud.errors import CapacityError


def check_admissible(session: Session, tenant_id: int, gpus: int, gpu_type: str | None) -> None:
    """Raise CapacityError if no pool (nodes not down, of `gpu_type` or any type) holds
    `gpus` GPUs, or if the tenant has quotas and each such type's is smaller than `gpus`."""
    pools = dict(
        session.execute(
            select(Node.gpu_type, func.sum(Node.gpus))
            .where(Node.state != NodeState.DOWN)
            .group_by(Node.gpu_type)
        ).all()
    )
    if gpu_type is not None:
        pools = {t: n for t, n in pools.items() if t == gpu_type}
    fitting = [t for t, n in pools.items() if n >= gpus]
    if not fitting:
        have = ", ".join(f"{n} x {t}" for t, n in sorted(pools.items())) or "no such GPUs"
        raise CapacityError(
            f"{gpus} GPUs of {gpu_type or 'any type'} can never run here: the cluster has {have}"
        )
    caps = dict(
        session.execute(
            select(Quota.gpu_type, Quota.gpus).where(Quota.tenant_id == tenant_id)
        ).all()
    )
    # A tenant with quotas may use only the types it has quota for; one without is unlimited.
    if caps and all(caps.get(t, 0) < gpus for t in fitting):
        limits = ", ".join(f"{caps.get(t, 0)} x {t}" for t in fitting)
        raise CapacityError(f"{gpus} GPUs exceed your tenant's quota ({limits})")
