"""Invariants over random clusters, tenants, jobs and policies (hypothesis).

Each example replays its jobs through the real Scheduler with a small event loop that
checks the state after every pass: no GPU, CPU or memory over-allocated, gangs whole,
indexes exact, quotas kept by tenants that may not borrow, no job started twice; and at
the end every job finished.
"""

from __future__ import annotations

import heapq

from hypothesis import given, settings
from hypothesis import strategies as st

from gpucloud.scheduler import POLICIES, ClusterState, Job, JobState, Node, Scheduler, Tenant
from gpucloud.scheduler.sim import Trace, TraceJob, parse_cluster, simulate
from scheduler.helpers import check_invariants

TYPES = ("H100-SXM", "Ascend-910B")

jobs_st = st.lists(
    st.tuples(
        st.integers(0, 5000),  # submit
        st.integers(1, 4000),  # duration
        st.sampled_from((1, 1, 2, 4, 8, 12)),  # GPUs
        st.sampled_from(("a", "b", "c")),  # tenant
        st.sampled_from(((), ("H100-SXM",), ("Ascend-910B", "H100-SXM"))),
        st.integers(0, 2),  # priority
        st.sampled_from((None, 0.2, 1.0, 5.0)),  # estimate factor (None = unknown)
        st.sampled_from((1000, 1000, 500, 250)),  # gpu_milli (fractional only for 1 GPU)
        st.sampled_from((0, 0, 1000, 4000)),  # CPU milli-cores per GPU (any node has 4000)
    ),
    min_size=1,
    max_size=40,
)


def _replay(
    policy_name: str, nodes: list[tuple[str, int, bool]], jobs, borrow_b: bool, cpu: int = 4000
) -> ClusterState:
    state = ClusterState(default_estimate=600)
    for i, (kind, n, tracked) in enumerate(nodes):
        # `cpu` milli-cores per GPU (or CPU not tracked) and 32 GiB per GPU
        state.add_node(Node(f"n{i}", kind, n, rack=f"rack-{i % 2}",
                            cpu_milli=cpu * n if tracked else 0, memory_mib=32768 * n))  # fmt: skip
    cap = {t: state.capacity(t) for t in state.pools}
    state.add_tenant(Tenant("a", {t: c / 2 for t, c in cap.items()}))
    state.add_tenant(Tenant("b", {t: c / 4 for t, c in cap.items()}, borrow=borrow_b))
    state.add_tenant(Tenant("c", {t: c / 4 for t, c in cap.items()}, borrow_limit=2))
    pending: list[Job] = []
    for i, (sub, dur, g, ten, types, prio, est, milli, cpu) in enumerate(jobs):
        types = tuple(t for t in types if t in state.pools) or ()
        largest = max(state.capacity(t) for t in (types or state.pools))
        g = min(g, largest)
        job = Job(f"j{i}", tenant=ten, num_gpus=g, gpu_types=types,
                  gpu_milli=milli if g == 1 else 1000, priority=prio, submit_time=sub,
                  estimate=None if est is None else dur * est, duration=dur,
                  checkpoint_interval=300, cpu_milli=cpu * g, memory_mib=16384 * g)  # fmt: skip
        pending.append(job)
    pending.sort(key=lambda j: j.submit_time)
    sched = Scheduler(POLICIES[policy_name])
    ends: list[tuple[float, int, Job, int]] = []
    starts: dict[str, int] = {}
    now, i = 0.0, 0
    for _ in range(10_000):
        if i == len(pending) and not ends and not state.pending:
            break
        candidates = [pending[i].submit_time] if i < len(pending) else []
        candidates += [ends[0][0]] if ends else []
        now = min(candidates) if candidates else now + 300
        while ends and ends[0][0] <= now:
            _, _, job, run = heapq.heappop(ends)
            if job.preemptions == run:
                state.finish(job, now)
        while i < len(pending) and pending[i].submit_time <= now:
            state.submit(pending[i])
            i += 1
        d = sched.schedule(state, now)
        check_invariants(state)
        if sched.policy.quotas:
            for tenant in ("b", "c"):
                for t, used in state.usage[tenant].items():
                    assert used <= _limit(state, tenant, t) + 1e-9
        for job, _ in d.starts:
            starts[job.id] = starts.get(job.id, 0) + 1
            assert starts[job.id] == job.preemptions + 1  # a job starts once per run
            heapq.heappush(ends, (now + job.duration - job.progress, job.seq, job, job.preemptions))
    return state


def _limit(state: ClusterState, tenant: str, gpu_type: str) -> float:
    """The most GPUs of a type a tenant may hold: its quota, plus its borrow limit."""
    t = state.tenants[tenant]
    if not t.borrow:
        return t.quota.get(gpu_type, 0.0)
    return t.quota.get(gpu_type, 0.0) + (t.borrow_limit if t.borrow_limit is not None else 1e9)


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    nodes=st.lists(
        st.tuples(st.sampled_from(TYPES), st.sampled_from((4, 8)), st.booleans()),
        min_size=1,
        max_size=4,
    ),  # fmt: skip
    jobs=jobs_st,
    borrow_b=st.booleans(),
)
def test_scheduler_invariants_hold_and_every_job_finishes(policy, nodes, jobs, borrow_b) -> None:
    state = _replay(policy, nodes, jobs, borrow_b)
    quotas = POLICIES[policy].quotas
    stuck = [
        j.id
        for j in state.jobs.values()
        if j.state is not JobState.SUCCEEDED  # only a job larger than its quota may wait forever
        and not (quotas and all(j.gpus > _limit(state, j.tenant, t) for t in state.pool_types(j)))
    ]
    assert not stuck, f"{policy}: jobs never finished: {stuck}"


@settings(max_examples=30, deadline=None)
@given(
    policy=st.sampled_from(("fifo", "gpucloud", "tiresias", "sjf")),
    nodes=st.lists(st.tuples(st.just("H100-SXM"), st.just(4), st.just(True)), min_size=1,
                   max_size=3),
    jobs=st.lists(
        st.tuples(st.integers(0, 3000), st.integers(1, 4000), st.just(1), st.just("a"),
                  st.just(()), st.just(0), st.just(1.0), st.sampled_from((250, 500, 1000)),
                  st.sampled_from((1000, 2000))),
        min_size=4, max_size=30,
    ),
)  # fmt: skip
def test_cpu_bound_nodes_are_never_over_allocated(policy, nodes, jobs) -> None:
    """Shared-GPU jobs that need more CPU per GPU than the nodes have per GPU run out of CPU
    before GPUs: every pass must respect CPU (check_invariants), and all still finish."""
    state = _replay(policy, nodes, jobs, True, cpu=2000)
    assert all(j.state is JobState.SUCCEEDED for j in state.jobs.values())


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.sampled_from((1, 2, 4, 8, 16)), min_size=5, max_size=60),
    durations=st.lists(st.integers(60, 20_000), min_size=60, max_size=60),
    policy=st.sampled_from(("fair", "gpucloud", "kueue", "fifo")),
)
def test_fair_policies_starve_no_one(sizes, durations, policy) -> None:
    """Under a burst, every job finishes and none waits longer than running every other
    job one after the other would take (plus work lost to preemptions): no starvation."""
    jobs = [
        TraceJob(f"j{i}", float(i * 10), float(durations[i]), g, tenant=("a", "b")[i % 2])
        for i, g in enumerate(sizes)
    ]
    nodes = parse_cluster("2x8")
    r = simulate(Trace("burst", "test", jobs), nodes, POLICIES[policy], tick=300)
    assert len(r.records) == len(jobs)
    lost = r.summary["preemptions"] * 1800
    bound = sum(j.duration for j in jobs) + lost
    assert r.summary["max_wait_s"] <= bound
