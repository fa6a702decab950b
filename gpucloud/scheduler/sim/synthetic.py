"""A synthetic trace: Poisson arrivals, chosen job sizes, log-normal durations, tenants.

The arrival rate follows from the offered load: load x capacity GPUs of work arrive per
second on average, given the mean GPU-seconds per job. Deterministic for a seed.
"""

from __future__ import annotations

import math

import numpy as np

from gpucloud.errors import UserError
from gpucloud.scheduler.sim.traces import Trace, TraceJob

DEFAULT_SIZES = {1: 0.55, 2: 0.1, 4: 0.12, 8: 0.15, 16: 0.05, 32: 0.03}


def synthetic_trace(
    n_jobs: int,
    capacity: int,
    load: float = 0.9,
    sizes: dict[int, float] | None = None,
    median_duration: float = 1800.0,
    duration_sigma: float = 1.5,
    tenants: tuple[str, ...] = ("team-a", "team-b", "team-c"),
    seed: int = 0,
) -> Trace:
    """`n_jobs` jobs whose offered load is `load` x `capacity` GPUs.

    Durations are log-normal with the given median and sigma (of the natural log);
    `sizes` maps GPU counts to probabilities. Raises UserError for impossible inputs.
    """
    sizes = sizes or DEFAULT_SIZES
    if n_jobs < 1 or capacity < 1 or load <= 0:
        raise UserError("synthetic trace needs n_jobs >= 1, capacity >= 1 and load > 0")
    if max(sizes) > capacity:
        raise UserError(f"job size {max(sizes)} is larger than the cluster ({capacity} GPUs)")
    rng = np.random.default_rng(seed)
    gpus = np.array(sorted(sizes))
    probs = np.array([sizes[g] for g in gpus], dtype=float)
    probs /= probs.sum()
    mean_work = float((gpus * probs).sum()) * median_duration * math.exp(duration_sigma**2 / 2)
    rate = load * capacity / mean_work
    submit = np.cumsum(rng.exponential(1.0 / rate, n_jobs))
    size = rng.choice(gpus, n_jobs, p=probs)
    duration = rng.lognormal(math.log(median_duration), duration_sigma, n_jobs)
    tenant = rng.integers(0, len(tenants), n_jobs)
    jobs = [
        TraceJob(f"syn-{i}", float(submit[i]), float(duration[i]), int(size[i]), tenant=tenants[t])
        for i, t in enumerate(tenant)
    ]
    return Trace(f"synthetic-{n_jobs}", "synthetic", jobs)
