"""A clairvoyant lower bound on the average JCT of any schedule of a trace.

A time-indexed LP (HiGHS, through scipy), a relaxation of every real schedule: time is
cut into slots; y[j, s] is the seconds job j runs in slot s, at most the part of the slot
inside [submit_j, submit_j + duration_j + W] (W = a wait limit; None = unlimited); every
job runs its whole true duration; in each slot the jobs' GPU-seconds fit the cluster's.
A job may be split across slots at no cost (preemption is free, gangs need no placement,
durations are known), so no real policy can beat it. Completion time is bounded below by
the mean busy time plus half the duration (a job runs at rate <= 1), and the mean busy
time by the earliest moment of each slot the job runs in.
"""

from __future__ import annotations

import math

import numpy as np


def jct_lower_bound(
    jobs: list[tuple[float, float, float]], gpus: int, slot: float, wait_limit: float | None = None
) -> float:
    """Average-JCT lower bound (seconds) for (submit, duration, GPUs) jobs on `gpus` GPUs.
    Raises RuntimeError if HiGHS does not solve the LP."""
    from scipy.optimize import linprog
    from scipy.sparse import csr_array

    horizon = max(s + d for s, d, _ in jobs) + sum(d * g for _, d, g in jobs) / gpus
    cost, upper, job_of, slot_of, weight = [], [], [], [], []
    durations, constant = [], 0.0
    for s, d, g in jobs:
        if d <= 0:
            continue  # runs at once, JCT 0
        end = s + d + wait_limit if wait_limit is not None else horizon
        j = len(durations)
        for k in range(int(s // slot), math.ceil(end / slot)):
            lo, hi = max(k * slot, s), min((k + 1) * slot, end)
            if hi > lo:
                cost.append(lo / d)
                upper.append(hi - lo)
                job_of.append(j)
                slot_of.append(k)
                weight.append(g)
        durations.append(d)
        constant += d / 2 - s
    if not durations:
        return 0.0
    n_vars, n_slots = len(cost), max(slot_of) + 1
    cols = np.arange(n_vars)
    a_eq = csr_array((np.ones(n_vars), (job_of, cols)), shape=(len(durations), n_vars))
    a_ub = csr_array((weight, (slot_of, cols)), shape=(n_slots, n_vars))
    res = linprog(
        np.array(cost), A_ub=a_ub, b_ub=np.full(n_slots, gpus * slot), A_eq=a_eq,
        b_eq=np.array(durations), bounds=np.column_stack([np.zeros(n_vars), upper]),
        method="highs",
    )  # fmt: skip
    if res.status != 0:
        raise RuntimeError(f"LP not solved: {res.message}")
    return (res.fun + constant) / len(jobs)
