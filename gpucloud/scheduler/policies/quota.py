"""Admission by tenant quota, with borrowing inside a cohort (as Kueue's ClusterQueues).

A job of a tenant that has no `Tenant` record is not limited. Otherwise, in GPU type t:
- within quota: the tenant's GPUs in use plus the job's fit its quota;
- borrowing: over quota, allowed when the job is preemptible (a borrower must be
  reclaimable), the tenant may borrow, stays within its borrow limit, and the cohort's
  total use stays within the cohort's total quota of t;
- no room: it could borrow, but the cohort's quota is all in use: like a job that does
  not fit, it may hold a reservation or reclaim;
- anything else (over quota and may not borrow, past its borrow limit, or asking more
  than its whole cohort's quota) waits without blocking other jobs.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from gpucloud.scheduler.state import ClusterState, Job


class Admission(Enum):
    WITHIN = "within"
    BORROW = "borrow"
    NO_ROOM = "no_room"
    WAIT = "wait"


def admit(
    state: ClusterState, job: Job, gpu_type: str, freed: Mapping[str, float] | None = None
) -> Admission:
    """How `job` is admitted in pool `gpu_type` now, or once the tenants in `freed` have
    given back that many GPUs of it (a preemption's victims, weighed before preempting)."""
    tenant = state.tenants.get(job.tenant)
    if tenant is None:
        return Admission.WITHIN
    freed = freed or {}
    used = state.usage.get(job.tenant, {}).get(gpu_type, 0.0) - freed.get(job.tenant, 0.0)
    quota = tenant.quota.get(gpu_type, 0.0)
    if used + job.gpus <= quota:
        return Admission.WITHIN
    if not (tenant.borrow and job.preemptible):
        return Admission.WAIT
    if tenant.borrow_limit is not None and used + job.gpus - quota > tenant.borrow_limit:
        return Admission.WAIT
    cohort_quota, cohort_used = cohort_totals(state, tenant.cohort, gpu_type, freed)
    if job.gpus > cohort_quota + _ROUNDING:
        return Admission.WAIT  # more than the whole cohort holds: no room will ever come
    if cohort_used + job.gpus <= cohort_quota + _ROUNDING:
        return Admission.BORROW
    return Admission.NO_ROOM


# GPUs by which a sum of quotas may miss its true value: fractional quotas (the
# simulator's are each tenant's share of the cluster) add up to 511.99999999999994 for
# 512 GPUs, and a job needing exactly the cohort's last GPUs had no room (a due gang then
# preempted jobs for GPUs it was refused, pass after pass). Usage is whole milli-GPUs, so
# a margin far below one milli-GPU decides nothing but rounding.
_ROUNDING = 1e-6


def cohort_totals(
    state: ClusterState, cohort: str, gpu_type: str, freed: Mapping[str, float] | None = None
) -> tuple[float, float]:
    """(sum of quotas, sum of GPUs in use, less `freed`) of type `gpu_type` over the
    cohort's tenants."""
    quota = used = 0.0
    for t in state.tenants.values():
        if t.cohort == cohort:
            quota += t.quota.get(gpu_type, 0.0)
            used += state.usage.get(t.name, {}).get(gpu_type, 0.0)
            if freed:
                used -= freed.get(t.name, 0.0)
    return quota, used


def is_borrowing(state: ClusterState, tenant: str, gpu_type: str) -> bool:
    """Whether `tenant` holds more GPUs of `gpu_type` than its quota (reclaimable)."""
    t = state.tenants.get(tenant)
    if t is None:
        return False
    return state.usage.get(tenant, {}).get(gpu_type, 0.0) > t.quota.get(gpu_type, 0.0)
