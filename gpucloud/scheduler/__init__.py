"""Multi-tenant GPU scheduling: a pure, deterministic core and a trace simulator.

`Scheduler(policy).schedule(state, now)` is the whole core (see `core.py`); the
simulator (`simulate`) and the control plane call that same function.
"""

from gpucloud.scheduler.core import Cause, Decisions, Scheduler, Wait
from gpucloud.scheduler.placement import PlacementConfig
from gpucloud.scheduler.policies import POLICIES, Policy, get_policy
from gpucloud.scheduler.sim import EstimateModel, Result, load_trace, parse_cluster, simulate
from gpucloud.scheduler.state import (
    MILLI,
    TRANSITIONS,
    Allocation,
    ClusterState,
    Job,
    JobState,
    Node,
    Tenant,
)

__all__ = [
    "MILLI",
    "POLICIES",
    "TRANSITIONS",
    "Allocation",
    "Cause",
    "ClusterState",
    "Decisions",
    "EstimateModel",
    "Job",
    "JobState",
    "Node",
    "PlacementConfig",
    "Policy",
    "Result",
    "Scheduler",
    "Tenant",
    "Wait",
    "get_policy",
    "load_trace",
    "parse_cluster",
    "simulate",
]
