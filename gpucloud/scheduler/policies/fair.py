"""Weighted fair share: dominant resource fairness over GPU types, by attained service now.

A tenant's dominant share is max over GPU types of (GPUs it holds / pool capacity),
divided by its weight. The order goes in rounds: each round offers every tenant's next
job, the tenant with the lowest share first; shares are re-read at each step, so a job
that starts raises its tenant's share. Rounds keep one tenant's blocked head from hiding
the other tenants' jobs. Inside a tenant, arrival order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from gpucloud.scheduler.state import ClusterState, Job


def dominant_share(state: ClusterState, tenant: str) -> float:
    use = state.usage.get(tenant, {})
    share = max((g / state.capacity(t) for t, g in use.items() if g > 0), default=0.0)
    t = state.tenants.get(tenant)
    return share / (t.weight if t else 1.0)


@dataclass(frozen=True, slots=True)
class Fair:
    name: str = "fair"

    def order(self, state: ClusterState, now: float) -> Iterator[Job]:
        q = state.queue("fair", _no_key, group=_tenant)
        heads = {t: iter(list(entries)) for t, entries in q.groups.items() if entries}
        nxt = {t: next(it)[-1] for t, it in heads.items()}
        rounds = dict.fromkeys(nxt, 0)
        while nxt:
            tenant = min(nxt, key=lambda t: (rounds[t], dominant_share(state, t), nxt[t].seq))
            rounds[tenant] += 1
            yield nxt[tenant]
            entry = next(heads[tenant], None)
            if entry is None:
                del nxt[tenant]
            else:
                nxt[tenant] = entry[-1]

    def rank(self, job: Job, now: float) -> tuple:
        return (job.seq,)


def _no_key(job: Job) -> tuple:
    return ()


def _tenant(job: Job) -> str:
    return job.tenant
