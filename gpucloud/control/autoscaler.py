"""Replicas that follow the load: how many an autoscaled deployment wants, pass by pass.

The load is the number of requests in flight through the /v1 gateway to the deployment's
replicas, averaged over the last `WINDOW` seconds. A deployment wants
ceil(load / target_in_flight) replicas, within min_replicas..max_replicas (as Knative's
concurrency target); requests that wait in the gateway because no replica is ready count
too, so a deployment scaled to zero (min_replicas 0) starts one for the first request. It
grows at once; it shrinks only to the most it wanted over the last
`scale_down_delay` seconds, so a lull between bursts does not stop replicas that take a
while to load again (as Kubernetes' scale-down stabilization window). A resize takes the
deployment's warm pool into account (control/warm_pool.py): growing promotes a replica
loaded already, shrinking puts one back in the pool.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.control.gateway import Gateway
from gpucloud.control.lifecycle import ReplicaState
from gpucloud.control.models import Deployment, Replica
from gpucloud.control.schemas import Autoscale
from gpucloud.control.services import audit
from gpucloud.control.services import deployments as service

WINDOW = 5.0  # seconds of load samples averaged into one recommendation


class Autoscaler:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self._load: dict[int, deque[tuple[float, int]]] = defaultdict(deque)
        self._wanted: dict[int, deque[tuple[float, int]]] = defaultdict(deque)

    def apply(self, session: Session, now: float) -> None:
        """Resize every active autoscaled deployment to what its load wants (one pass)."""
        deps = session.scalars(
            select(Deployment).where(
                Deployment.state == service.ACTIVE,
                Deployment.autoscale.is_not(None),
                Deployment.reclaimed_replicas.is_(None),  # idle reclaim's until woken
            )
        ).all()
        in_flight: dict[int, int] = defaultdict(int)  # deployment id -> requests in flight
        live_replicas = session.execute(
            select(Replica.deployment_id, Replica.id).where(
                Replica.deployment_id.in_([d.id for d in deps]),
                Replica.state != ReplicaState.STOPPED,
            )
        )
        for dep_id, rid in live_replicas:
            in_flight[dep_id] += self.gateway.balancer.in_flight.get(rid, 0)
        for dep in deps:  # requests waiting for a replica to start are load too
            in_flight[dep.id] += self.gateway.cold_waiting.get(dep.id, 0)
        for dep in deps:
            spec = Autoscale(**dep.autoscale)
            wanted = self.wanted(dep.id, spec, dep.replicas, in_flight[dep.id], now)
            if wanted != dep.replicas:
                audit.record(session, None, "deployment.autoscale", f"deployment/{dep.name}",
                             tenant_id=dep.tenant_id, replicas=wanted,
                             was=dep.replicas)  # fmt: skip
                service.resize(session, dep, wanted)
        live = {d.id for d in deps}
        for history in (self._load, self._wanted):
            for gone in set(history) - live:
                del history[gone]

    def wanted(self, key: int, spec: Autoscale, current: int, in_flight: int, now: float) -> int:
        """The replicas deployment `key` wants now, given `in_flight` requests."""
        load = _recent(self._load[key], now, WINDOW, in_flight)
        need = math.ceil(sum(v for _, v in load) / len(load) / spec.target_in_flight - 1e-9)
        need = min(max(need, spec.min_replicas), spec.max_replicas)
        wanted = _recent(self._wanted[key], now, spec.scale_down_delay, need)
        return need if need >= current else min(current, max(v for _, v in wanted))


def _recent(samples: deque[tuple[float, int]], now: float, span: float, value: int) -> deque:
    """`samples` with (now, value) added and those older than `span` seconds dropped."""
    samples.append((now, value))
    while samples[0][0] < now - span:
        samples.popleft()
    return samples
