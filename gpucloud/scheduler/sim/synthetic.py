"""A synthetic trace: an arrival process, a duration distribution and gang sizes, seeded.

- Arrivals: Poisson, or diurnal (a Poisson process whose rate follows a sine over the
  day, `diurnal_amplitude` x the mean at its peak, drawn by thinning).
- Durations: log-normal (median and sigma of the natural log), or Pareto (heavy tail with
  shape `pareto_shape`, scaled to the same median), both capped at `max_duration`.
- Gang sizes: `sizes` maps GPU counts to probabilities; `LARGE_GANG_SIZES` adds a tail of
  gangs on 16 to 32 nodes of 8 GPUs.

The arrival rate follows from the offered load: on average load x capacity GPUs of work
arrive per second, measured over the drawn jobs themselves, so the trace has exactly the
load asked for. Deterministic for a seed.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

from gpucloud.errors import UserError
from gpucloud.scheduler.sim.traces import Trace, TraceJob

DEFAULT_SIZES = {1: 0.55, 2: 0.1, 4: 0.12, 8: 0.15, 16: 0.05, 32: 0.03}
# ITP-like sizes with a tail of large gangs: 128 and 256 GPUs are 16 and 32 nodes of 8
LARGE_GANG_SIZES = {1: 0.45, 2: 0.08, 4: 0.1, 8: 0.25, 16: 0.06, 32: 0.03, 64: 0.015,
                    128: 0.01, 256: 0.005}  # fmt: skip
DAY = 86400.0


def synthetic_trace(
    n_jobs: int,
    capacity: int,
    load: float = 0.9,
    sizes: dict[int, float] | None = None,
    median_duration: float = 1800.0,
    duration_sigma: float = 1.5,
    tenants: tuple[str, ...] = ("team-a", "team-b", "team-c"),
    seed: int = 0,
    arrivals: Literal["poisson", "diurnal"] = "poisson",
    diurnal_amplitude: float = 0.8,
    durations: Literal["lognormal", "pareto"] = "lognormal",
    pareto_shape: float = 1.3,
    max_duration: float = 30 * DAY,
) -> Trace:
    """`n_jobs` jobs whose offered load is `load` x `capacity` GPUs (see the module doc).
    Raises UserError for impossible inputs."""
    sizes = sizes or DEFAULT_SIZES
    if n_jobs < 1 or capacity < 1 or load <= 0 or median_duration <= 0:
        raise UserError(
            "synthetic trace needs n_jobs >= 1, capacity >= 1, load > 0, median_duration > 0"
        )
    if max(sizes) > capacity:
        raise UserError(f"job size {max(sizes)} is larger than the cluster ({capacity} GPUs)")
    if not 0 <= diurnal_amplitude < 1 or pareto_shape <= 1:
        raise UserError("diurnal_amplitude must be in [0, 1) and pareto_shape > 1")
    if arrivals not in ("poisson", "diurnal") or durations not in ("lognormal", "pareto"):
        raise UserError("arrivals must be poisson or diurnal; durations lognormal or pareto")
    rng = np.random.default_rng(seed)
    gpus = np.array(sorted(sizes))
    probs = np.array([sizes[g] for g in gpus], dtype=float)
    probs /= probs.sum()
    size = rng.choice(gpus, n_jobs, p=probs)
    if durations == "pareto":
        scale = median_duration / 2 ** (1 / pareto_shape)  # Pareto median = scale x 2^(1/a)
        duration = scale * (1 + rng.pareto(pareto_shape, n_jobs))
    else:
        duration = rng.lognormal(math.log(median_duration), duration_sigma, n_jobs)
    duration = np.minimum(duration, max_duration)
    rate = load * capacity / float((size * duration).mean())
    submit = _arrival_times(rng, n_jobs, rate, diurnal_amplitude if arrivals == "diurnal" else 0)
    tenant = rng.integers(0, len(tenants), n_jobs)
    jobs = [
        TraceJob(f"syn-{i}", float(submit[i]), float(duration[i]), int(size[i]), tenant=tenants[t])
        for i, t in enumerate(tenant)
    ]
    name = f"synthetic-{n_jobs}" if (arrivals, durations) == ("poisson", "lognormal") else (
        f"synthetic-{arrivals}-{durations}-{n_jobs}-s{seed}"
    )  # fmt: skip
    return Trace(name, "synthetic", jobs)


def _arrival_times(rng: np.random.Generator, n: int, rate: float, amplitude: float) -> np.ndarray:
    """`n` arrival times of a Poisson process of mean rate `rate` whose rate is
    rate x (1 + amplitude x sin(2 pi t / day)); amplitude 0 = homogeneous."""
    if amplitude == 0:
        return np.cumsum(rng.exponential(1.0 / rate, n))
    peak = rate * (1 + amplitude)
    out: list[float] = []
    t = 0.0
    while len(out) < n:
        gaps = np.cumsum(rng.exponential(1.0 / peak, 2 * (n - len(out)))) + t
        keep = rng.random(len(gaps)) * (1 + amplitude) < 1 + amplitude * np.sin(
            2 * math.pi * gaps / DAY
        )
        out.extend(gaps[keep][: n - len(out)].tolist())
        t = float(gaps[-1])
    return np.asarray(out)
