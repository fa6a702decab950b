"""Workload inflation, the FGD paper's evaluation of GPU-sharing placement.

Pods are drawn from a trace with replacement (seeded) and placed one after another on an
empty cluster, never leaving, until the GPUs they ask for reach `until` x the cluster's
capacity. A pod that fits nowhere fails and is skipped. Along the way the curve records,
against the arrived workload, the FGD fragmentation and the share of requested GPUs that
could not be allocated. docs/simulator.md ("Inflation (FGD)") gives the exact semantics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpucloud.errors import UserError
from gpucloud.scheduler.fgd import Workload, fgd_fragmentation
from gpucloud.scheduler.placement import PlacementConfig, place
from gpucloud.scheduler.sim.cluster import describe, empty_state
from gpucloud.scheduler.sim.traces import Trace, TraceJob
from gpucloud.scheduler.state import MILLI, ClusterState, Job, Node

POINTS = tuple(i / 100 for i in range(101))  # default samples: every 1% of capacity
_DRAW = 1024  # pods drawn from the generator at a time


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """The cluster once the arrived workload reached `arrived` x capacity."""

    arrived: float  # requested GPUs of the arrived pods / cluster GPUs
    allocated_gpus: float  # GPUs (shares summed) held by placed pods
    failed_gpus: float  # GPUs asked for by pods that fit nowhere
    fragmented_gpus: float  # FGD's expected fragmented GPUs
    fragmentation_rate: float  # fragmented / idle GPUs (0 when none are idle)
    failure_share: float  # failed / requested GPUs (0 before the first pod)


@dataclass(frozen=True, slots=True)
class Inflation:
    placement: str
    trace: str
    cluster: str
    capacity: int
    pods: int  # pods that arrived
    failed_pods: int
    curve: tuple[CurvePoint, ...]

    def at(self, arrived: float) -> CurvePoint:
        """The last point recorded at or below `arrived` x capacity."""
        return [p for p in self.curve if p.arrived <= arrived + 1e-9][-1]

    def summary(self, marks: Sequence[float] = (0.5, 0.7, 0.9, 1.0)) -> dict:
        """JSON-ready figures: the run, its end point, and the curve at `marks`."""
        return {
            "placement": self.placement,
            "trace": self.trace,
            "cluster": self.cluster,
            "capacity_gpus": self.capacity,
            "pods": self.pods,
            "failed_pods": self.failed_pods,
            "end": _point(self.curve[-1]),
            "at": {f"{m:g}": _point(self.at(m)) for m in marks},
            "curve": [_point(p) for p in self.curve],
        }


def _point(p: CurvePoint) -> dict:
    return {k: getattr(p, k) for k in CurvePoint.__slots__}


def inflate(
    trace: Trace,
    nodes: Sequence[Node],
    placement: str = "pack",
    seed: int = 0,
    until: float = 1.0,
    points: Sequence[float] = POINTS,
) -> Inflation:
    """Inflate `trace` on an empty cluster of `nodes` under a placement strategy (`pack`,
    `spread` or `fgd`; fgd targets the trace's mix of pod classes) and sample the curve at
    each of `points` (fractions of capacity, up to `until`).

    Raises UserError for an empty trace or cluster, `until` <= 0, or an unknown strategy.
    """
    if not trace.jobs:
        raise UserError(f"trace {trace.name} has no pods to draw from")
    if not nodes:
        raise UserError("the cluster has no nodes")
    if until <= 0:
        raise UserError(f"until must be > 0 (a share of cluster capacity), got {until}")
    mix = Workload.of((j.num_gpus, j.gpu_milli, j.cpu_milli, j.memory_mib) for j in trace.jobs)
    # consolidate: a pod that fits in a node never spans nodes
    cfg = PlacementConfig(placement, consolidate=True, workload=mix if placement == "fgd" else None)
    state = empty_state(list(nodes))
    capacity = state.capacity()
    marks = sorted(p * capacity for p in points if 0 <= p <= until)
    rng = np.random.default_rng(seed)
    run = _Run(state, cfg, mix, capacity)
    while True:
        for i in rng.integers(len(trace.jobs), size=_DRAW):
            j = trace.jobs[i]
            ask = j.num_gpus * j.gpu_milli / MILLI
            while marks and marks[0] < run.arrived + ask:
                marks.pop(0)
                run.record()
            if run.arrived + ask > until * capacity:
                run.record()
                return Inflation(
                    placement, trace.name, describe(list(nodes)), capacity, run.pods,
                    run.failed_pods, tuple(run.curve),
                )  # fmt: skip
            run.arrive(j)


class _Run:
    """The inflating cluster and its running totals."""

    def __init__(
        self, state: ClusterState, cfg: PlacementConfig, mix: Workload, capacity: int
    ) -> None:
        self.state, self.cfg, self.mix, self.capacity = state, cfg, mix, capacity
        self.arrived = self.allocated = self.failed = 0.0
        self.pods = self.failed_pods = 0
        self.curve: list[CurvePoint] = []

    def arrive(self, pod: TraceJob) -> None:
        """Place one pod through the core's placement, or count it as failed."""
        num = pod.num_gpus
        job = Job(
            f"pod-{self.pods}", num_gpus=num, gpu_milli=pod.gpu_milli,
            cpu_milli=pod.cpu_milli, memory_mib=pod.memory_mib,
        )  # fmt: skip
        self.pods += 1
        ask = job.gpus
        self.arrived += ask
        for t in self.state.pool_types(job):
            if num <= self.state.pools[t].max_node:
                alloc = place(self.state, job, t, self.cfg)
                if alloc is not None:
                    self.state.submit(job)
                    self.state.start(job, alloc, 0.0)
                    self.allocated += ask
                    return
        self.failed += ask
        self.failed_pods += 1

    def record(self) -> None:
        """Sample the curve, once per cluster state."""
        if self.curve and self.curve[-1].arrived == self.arrived / self.capacity:
            return
        frag = fgd_fragmentation(self.state, self.mix)
        idle = self.capacity - self.allocated
        self.curve.append(
            CurvePoint(
                self.arrived / self.capacity,
                self.allocated,
                self.failed,
                frag,
                frag / idle if idle > 1e-9 else 0.0,
                self.failed / self.arrived if self.arrived else 0.0,
            )
        )


def write_plot(results: Sequence[Inflation], out: Path) -> Path:
    """Write inflation.png into `out`: fragmentation rate and unallocated share of requested
    GPUs against the arrived workload, one line per placement. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    path = out / "inflation.png"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in (
        (axes[0], "fragmentation_rate", "fragmented GPUs (% of idle GPUs)"),
        (axes[1], "failure_share", "unallocated GPUs (% of requested)"),
    ):
        for r in results:
            x = [100 * p.arrived for p in r.curve]
            ax.plot(x, [100 * getattr(p, key) for p in r.curve], label=r.placement)
        ax.set(xlabel="arrived workload (% of cluster GPUs)", ylabel=label)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{results[0].trace} inflated on {results[0].cluster}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
