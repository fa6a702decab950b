"""Automatic rollback: a canary that does worse than its stable version is rolled back.

Each reconciler pass compares, over its guard's window (schemas.CanaryGuard), the
requests the gateway sent to the canary's replicas with those the stable version's
replicas got (replica_stats.py: stored as they come, so a restart of the control plane
keeps the window's samples); once the canary has served `min_requests`, an error rate
higher by more than `max_error_rate_increase`, or a p99 time to first token more than
`max_ttft_ratio` times the stable one's, rolls it back, audited with the figures. So does
a canary that never gets going (a broken model dir, a crash loop): its replicas restarted
`max_restarts` times (3 by default), or none of them ready `ready_within` seconds (300)
after its first one was created.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.control.db import Store
from gpucloud.control.lifecycle import ReplicaState, VersionState
from gpucloud.control.models import Deployment, DeploymentVersion, Replica
from gpucloud.control.replica_stats import ReplicaStats, Window
from gpucloud.control.schemas import CanaryGuard
from gpucloud.control.services import deployments as service
from gpucloud.control.services import versions


def judge(canary: Window, stable: Window, guard: CanaryGuard) -> str | None:
    """Why the canary must be rolled back, or None while it holds its bounds (or has not
    served enough requests to tell)."""
    if canary.requests < guard.min_requests:
        return None
    seen = f"over the last {guard.window:g} s ({canary.requests} canary requests)"
    if canary.error_rate - stable.error_rate > guard.max_error_rate_increase:
        return (
            f"canary error rate {canary.error_rate:.1%} vs stable {stable.error_rate:.1%} "
            f"{seen}: more than {guard.max_error_rate_increase:.1%} higher"
        )
    mine, theirs = canary.p99_ttft, stable.p99_ttft
    if mine is not None and theirs is not None and mine > guard.max_ttft_ratio * theirs:
        return (
            f"canary p99 time to first token {mine:.3f} s vs stable {theirs:.3f} s {seen}: "
            f"more than {guard.max_ttft_ratio:g} times"
        )
    return None


@dataclass(frozen=True, slots=True)
class Starts:
    """How a canary's replicas got going."""

    restarts: int  # of all its replicas, whatever the cause
    ready: bool  # one of them has been ready
    age: float  # seconds since its first replica was created


def judge_starts(starts: Starts, guard: CanaryGuard) -> str | None:
    """Why a canary that does not get going must be rolled back, or None."""
    if starts.restarts >= guard.max_restarts:
        return (
            f"canary replicas restarted {starts.restarts} times (at most "
            f"{guard.max_restarts - 1} allowed): they crash or fail their probes"
        )
    if not starts.ready and starts.age > guard.ready_within:
        return f"no canary replica ready {guard.ready_within:g} s after the first one was created"
    return None


class AutoRollback:
    def __init__(self, stats: ReplicaStats) -> None:
        self.stats = stats

    def apply(self, store: Store, now: float) -> None:
        """Roll back every guarded canary that breaks its bounds (`now`: wall clock), and
        store its deployment's new samples. Judged in a read transaction: a pass with
        nothing to roll back and no new sample to store takes no write lock."""
        with store.reading() as session:
            guarded = self._guarded(session)
            watched = {r.id for *_, by_version in guarded for v in by_version.values() for r in v}
            oldest = now - max((g.window for _, _, _, g, _ in guarded), default=0.0)
            self.stats.load(session, watched, oldest)
            breaking = [(dep.id, why) for dep, why in self._judged(guarded, now) if why]
            live = session.scalars(select(Replica.id).where(Replica.state != ReplicaState.STOPPED))
            self.stats.forget(set(live))
        self.stats.save(store, watched, oldest)
        for dep_id, why in breaking:
            with store.transaction() as session:
                dep = session.get(Deployment, dep_id)
                if dep is not None and VersionState.CANARY in versions.served(session, dep.id):
                    service.rollback(session, None, dep, f"automatic: {why}")

    def _guarded(self, session: Session) -> list[tuple]:
        """Each active deployment with a guarded canary: (deployment, canary version,
        stable version, guard, every replica of the two)."""
        canaries = session.execute(
            select(DeploymentVersion, Deployment)
            .join(Deployment, DeploymentVersion.deployment_id == Deployment.id)
            .where(
                DeploymentVersion.state == VersionState.CANARY,
                DeploymentVersion.guard.is_not(None),
                Deployment.state == service.ACTIVE,
            )
        ).all()
        guarded = []
        for canary, dep in canaries:
            stable = versions.served(session, dep.id)[VersionState.STABLE]
            rows = self._replicas(session, dep.id, (canary.id, stable.id))
            guarded.append((dep, canary, stable, CanaryGuard(**canary.guard), rows))
        return guarded

    def _judged(self, guarded: list[tuple], now: float) -> list[tuple[Deployment, str | None]]:
        """Each deployment of `guarded`, and why its canary must roll back (None: it
        holds)."""
        judged = []
        for dep, canary, stable, guard, rows in guarded:
            since = now - guard.window
            seen = [self.stats.window([r.id for r in rows[v.id]], since) for v in (canary, stable)]
            mine = rows[canary.id]
            why = judge_starts(_starts(mine), guard) if mine else None
            judged.append((dep, why or judge(*seen, guard)))
        return judged

    @staticmethod
    def _replicas(session: Session, dep_id: int, version_ids: tuple[int, ...]) -> dict[int, list]:
        """Every replica each version had (id, restarts, ready_at, created_at), by version id."""
        found: dict[int, list] = defaultdict(list)
        rows = session.execute(
            select(
                Replica.version_id, Replica.id, Replica.restarts, Replica.ready_at,
                Replica.created_at,
            ).where(Replica.deployment_id == dep_id, Replica.version_id.in_(version_ids))
        )  # fmt: skip
        for row in rows:
            found[row.version_id].append(row)
        return found


def _starts(replicas: list) -> Starts:
    return Starts(
        restarts=sum(r.restarts for r in replicas),
        ready=any(r.ready_at is not None for r in replicas),
        age=time.time() - min(r.created_at for r in replicas),
    )
