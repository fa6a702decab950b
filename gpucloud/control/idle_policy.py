"""Idle reclaim's rules: which idle TTL applies to a workload, when it is warned, and what
its views say. The reclaimer that applies them each pass is control/idle.py."""

from __future__ import annotations

import time

from gpucloud.durations import format_duration

WARN_AT = 0.8  # the fraction of its idle TTL after which a workload is warned
BUSY_UTILISATION = 5.0  # percent: an accelerator busier than this is in use


def ttl(own: float | None, tenant: float | None, cluster: float | None) -> float | None:
    """The idle TTL in force: the workload's own, else its tenant's, else the cluster's;
    None (or 0) when it is never reclaimed."""
    for value in (own, tenant, cluster):
        if value is not None:
            return value or None
    return None


def at(moment: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(moment))


def deployment_notice(reclaim_at: float | None, reclaimed_replicas: int | None) -> str | None:
    """What `deploy get` says about a deployment's idleness (None: nothing to say)."""
    if reclaimed_replicas is not None:
        return (
            f"scaled to zero while idle: the next request starts its {reclaimed_replicas} "
            "replica(s) again"
        )
    if reclaim_at is not None:
        return f"idle: scaled to zero at {at(reclaim_at)} unless a request comes"
    return None


def job_notice(reclaim_at: float | None) -> str | None:
    if reclaim_at is None:
        return None
    return f"idle: stopped at {at(reclaim_at)} unless its accelerators are used"


def idle_for(seconds: float) -> str:
    return format_duration(round(seconds, 1) if seconds < 60 else round(seconds))
