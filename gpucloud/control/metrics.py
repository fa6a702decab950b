"""Prometheus metrics of the control plane, in a registry per app.

Counts of jobs, queue length and allocated GPUs are read from the store when Prometheus
scrapes, so they are right even after a restart; latencies are observed as they happen.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import Float, cast, func, select

from gpucloud.control.alerts.metrics import AlertCollector
from gpucloud.control.db import Store
from gpucloud.control.lifecycle import REPLICA_HOLDS_GPUS, JobState, ReplicaState
from gpucloud.control.models import Deployment, Job, Node, Replica, Tenant

if TYPE_CHECKING:
    from gpucloud.hal.telemetry import Monitor

_WAITING = (JobState.PENDING, JobState.RETRYING, JobState.PREEMPTED)
# Seconds: a millisecond's resolution where an interactive request's phases fall, and
# minutes for a batch request's wait for its slot.
_PHASE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
_PHASE_BUCKETS += (10, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self, store: Store) -> None:
        self.registry = CollectorRegistry()
        self.api_latency = Histogram(
            "gpucloud_api_request_seconds",
            "API request latency",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.scheduling_pass = Histogram(
            "gpucloud_scheduling_pass_seconds",
            "Time of one reconciler pass: load state, decide, apply",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.scheduling_phase = Counter(
            "gpucloud_scheduling_phase_seconds",
            "Time spent in each phase of the reconciler's passes (observe the executor, "
            "load the state, decide, apply)",
            ["phase"],
            registry=self.registry,
        )
        self.gateway_requests = Counter(
            "gpucloud_gateway_requests",
            "Requests the /v1 gateway relayed, by tenant, deployment and status",
            ["tenant", "deployment", "status"],
            registry=self.registry,
        )
        self.gateway_batch_waiting = Gauge(
            "gpucloud_gateway_batch_waiting",
            "Batch-class requests waiting in the /v1 gateway for a slot, by deployment",
            ["tenant", "deployment"],
            registry=self.registry,
        )
        self.gateway_phase = Histogram(
            "gpucloud_gateway_phase_seconds",
            "Time of /v1 gateway requests up to their first token, by phase: admit (route, "
            "limits, a batch request's wait for a slot), upstream (to the replica's response "
            "headers), first_chunk (to a stream's first event), first_write (relayed)",
            ["tenant", "deployment", "priority_class", "phase"],
            buckets=_PHASE_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_StoreCollector(store))
        self.registry.register(AlertCollector(store))  # what the shipped alert rules read

    def watch_devices(self, node: str, telemetry: Monitor) -> None:
        """Export the devices of `node` under dcgm-exporter's names (gpucloud.hal.dcgm)."""
        self.registry.register(_DeviceCollector(node, telemetry))


class _DeviceCollector:
    def __init__(self, node: str, telemetry: Monitor) -> None:
        self.node, self.telemetry = node, telemetry

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from gpucloud.hal import dcgm

        samples = self.telemetry.latest()
        yield from dcgm.families(self.node, samples, self.telemetry.source.device_node)


class _StoreCollector:
    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily(
            "gpucloud_jobs", "Jobs by tenant and state", labels=["tenant", "state"]
        )
        queue = GaugeMetricFamily("gpucloud_queue_length", "Jobs waiting to run")
        gpus = GaugeMetricFamily(
            "gpucloud_gpus_allocated", "GPUs held by tenant and type", labels=["tenant", "gpu_type"]
        )
        capacity = GaugeMetricFamily(
            "gpucloud_gpus_total",
            "GPUs on nodes by type and node state",
            labels=["gpu_type", "state"],
        )
        with self.store.reading() as s:
            by_state = s.execute(
                select(Tenant.name, Job.state, func.count())
                .select_from(Job)
                .join(Tenant, Job.tenant_id == Tenant.id)
                .group_by(Tenant.name, Job.state)
            )
            waiting = 0
            for tenant, state, n in by_state:
                jobs.add_metric([tenant, state], n)
                waiting += n if state in _WAITING else 0
            waiting += (
                s.scalar(
                    select(func.count())
                    .select_from(Replica)
                    .where(Replica.state == ReplicaState.PENDING)
                )
                or 0
            )
            queue.add_metric([], waiting)
            held: dict[tuple[str, str], float] = {}
            job_rows = s.execute(
                select(Tenant.name, Node.gpu_type, cast(Job.gpus * Job.gpu_milli, Float) / 1000)
                .select_from(Job)
                .join(Tenant, Job.tenant_id == Tenant.id)
                .join(Node, Job.node_id == Node.id)
                .where(Job.state == JobState.RUNNING)
            )
            replica_rows = s.execute(
                select(
                    Tenant.name,
                    Node.gpu_type,
                    cast(Deployment.gpus_per_replica * Deployment.gpu_milli, Float) / 1000,
                )
                .select_from(Replica)
                .join(Deployment, Replica.deployment_id == Deployment.id)
                .join(Tenant, Deployment.tenant_id == Tenant.id)
                .join(Node, Replica.node_id == Node.id)
                .where(Replica.state.in_(REPLICA_HOLDS_GPUS))
            )
            for tenant, gpu_type, n in [*job_rows, *replica_rows]:
                held[tenant, gpu_type] = held.get((tenant, gpu_type), 0) + n
            for (tenant, gpu_type), n in sorted(held.items()):
                gpus.add_metric([tenant, gpu_type], n)
            for gpu_type, state, n in s.execute(
                select(Node.gpu_type, Node.state, func.sum(Node.gpus)).group_by(
                    Node.gpu_type, Node.state
                )
            ):
                capacity.add_metric([gpu_type, state], n)
        yield from (jobs, queue, gpus, capacity)
