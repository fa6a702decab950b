"""Trace-driven simulation of the scheduler core: traces, clusters, replay, metrics."""

from gpucloud.scheduler.sim.cluster import parse_cluster
from gpucloud.scheduler.sim.simulator import EstimateModel, Result, simulate
from gpucloud.scheduler.sim.synthetic import synthetic_trace
from gpucloud.scheduler.sim.traces import Trace, TraceJob, load_trace, write_trace

__all__ = [
    "EstimateModel",
    "Result",
    "Trace",
    "TraceJob",
    "load_trace",
    "parse_cluster",
    "simulate",
    "synthetic_trace",
    "write_trace",
]
