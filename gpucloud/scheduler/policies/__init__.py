"""Scheduling policies: an ordering plus switches for backfill, quotas, preemption and
placement. `POLICIES` holds the named presets; each ordering lives in its own module."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from gpucloud.errors import unknown_name
from gpucloud.scheduler.placement import PlacementConfig
from gpucloud.scheduler.policies.fair import Fair
from gpucloud.scheduler.policies.fifo import Fifo
from gpucloud.scheduler.policies.las import Las
from gpucloud.scheduler.policies.priority import Priority
from gpucloud.scheduler.policies.sjf import Sjf
from gpucloud.scheduler.policies.tiers import Tiers
from gpucloud.scheduler.state import ClusterState, Job


class Ordering(Protocol):
    name: str

    def order(self, state: ClusterState, now: float) -> Iterable[Job]:
        """Pending jobs, most important first."""
        ...

    def rank(self, job: Job, now: float) -> tuple:
        """Importance of a pending or running job (lower = more important); a pending job
        may preempt a running one of strictly higher rank when the policy preempts."""
        ...


@dataclass(frozen=True, slots=True)
class Policy:
    """One scheduling policy.

    backfill: "none" = strict, the first job that cannot start blocks all later ones;
    "greedy" = later jobs start whenever they fit (may delay big jobs forever);
    "easy" = later jobs start only if they cannot delay the first blocked job.
    starvation_after: a job that has waited longer than this (seconds since submit, minus
    the time it ran) jumps ahead of the ordering, in arrival order, may preempt jobs that
    are not starving, and once running is never preempted.
    """

    name: str
    ordering: Ordering = field(default_factory=Fifo)
    backfill: Literal["none", "greedy", "easy"] = "none"
    backfill_depth: int = 64  # blocked jobs looked past per pass: keeps a pass O(depth)
    quotas: bool = False
    preempt: bool = False  # by rank (priority class, LAS queue)
    reclaim: bool = False  # a tenant within quota takes back GPUs others borrowed
    min_run: float = 600.0  # seconds a job runs before it may be preempted (no thrashing)
    preempt_tries: int = 2  # blocked jobs per pass that may look for victims
    starvation_after: float | None = None
    placement: PlacementConfig = field(default_factory=PlacementConfig)

    def with_(self, **changes) -> Policy:
        return replace(self, **changes)


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in [
        Policy("fifo"),
        Policy("sjf", Sjf(), backfill="easy"),
        Policy("sjf-oracle", Sjf(oracle=True), backfill="greedy"),
        Policy("priority", Priority(), backfill="easy", preempt=True),
        Policy("fair", Fair(), backfill="easy"),
        Policy("tiresias", Las(), backfill="greedy", preempt=True),
        Policy("kueue", Fifo(), backfill="greedy", quotas=True, reclaim=True),
        # Short jobs first by estimated GPU-time tier, FIFO inside a tier (so long jobs
        # keep their arrival order), EASY backfill, quotas with borrowing and reclaim, and
        # a starvation guard that lets a job waiting over 300 h preempt its way in.
        Policy(
            "gpucloud",
            Tiers((16 * 3600.0,)),
            backfill="easy",
            quotas=True,
            reclaim=True,
            starvation_after=300 * 3600.0,
        ),
    ]
}


def get_policy(name: str) -> Policy:
    """The preset called `name`. Raises NotFoundError naming the closest presets."""
    try:
        return POLICIES[name]
    except KeyError:
        raise unknown_name("policy", name, POLICIES) from None
