from __future__ import annotations

from pathlib import Path

import pytest

from gpucloud.errors import UserError
from gpucloud.scheduler import POLICIES, EstimateModel, Node, Tenant, simulate
from gpucloud.scheduler.sim import Trace, TraceJob, load_trace, parse_cluster
from gpucloud.scheduler.sim.cluster import describe
from gpucloud.scheduler.sim.metrics import jain_index

TRACES = Path("/work/shared/traces")
KEYS = {"avg_jct_s", "p95_jct_s", "avg_queue_s", "p95_queue_s", "max_wait_s", "makespan_s",
        "utilization", "preemptions", "jain_fairness", "jobs"}  # fmt: skip


def _trace(*jobs: tuple[float, float, int]) -> Trace:
    return Trace("t", "test", [TraceJob(f"j{i}", s, d, g) for i, (s, d, g) in enumerate(jobs)])


def test_fifo_replay_by_hand() -> None:
    # 8 GPUs. j0 (8 GPUs, 100 s) at 0; j1 (4, 50) at 10 waits for j0; j2 (2, 10) at 20 is
    # behind j1 in strict FIFO; both start at 100; a 9-GPU job is skipped and counted.
    tr = _trace((0, 100, 8), (10, 50, 4), (20, 10, 2), (30, 5, 9))
    r = simulate(tr, parse_cluster("1x8"), POLICIES["fifo"])
    got = {x.id: (x.first_start, x.end) for x in r.records}
    assert got == {"j0": (0, 100), "j1": (100, 150), "j2": (100, 110)}
    s = r.summary
    assert s["skipped"] == 1 and s["jobs"] == 3
    assert s["avg_jct_s"] == pytest.approx((100 + 140 + 90) / 3)
    assert s["max_wait_s"] == 90 and s["makespan_s"] == 150
    # allocated GPU-time 8*100 + 4*50 + 2*10 = 1020 over 8 GPUs x 150 s
    assert s["utilization"] == pytest.approx(1020 / 1200)
    assert set(s) >= KEYS


def test_replay_is_deterministic_and_estimates_only_matter_through_the_seed() -> None:
    tr = load_trace(TRACES / "microsoft_itp_2021/raw/cluster03.csv", limit=300)
    nodes = parse_cluster("4x8")
    a = simulate(tr, nodes, POLICIES["gpucloud"], seed=1).summary
    assert a == simulate(tr, nodes, POLICIES["gpucloud"], seed=1).summary
    exact = EstimateModel(0.0, 0.0)
    sjf = simulate(tr, nodes, POLICIES["sjf"], estimates=exact).summary
    oracle = POLICIES["sjf-oracle"].with_(backfill="easy")
    assert sjf == {**simulate(tr, nodes, oracle, estimates=exact).summary, "policy": "sjf"}
    noisy = simulate(tr, nodes, POLICIES["sjf"], estimates=EstimateModel(2.0, 0.3)).summary
    assert noisy["avg_jct_s"] != sjf["avg_jct_s"]


def test_preemption_loses_work_since_the_last_checkpoint() -> None:
    tr = Trace("t", "test", [TraceJob("low", 0, 7200, 8), TraceJob("high", 4000, 100, 8,
                                                                   priority=5)])  # fmt: skip
    r = simulate(tr, parse_cluster("1x8"), POLICIES["priority"], checkpoint_interval=1800)
    low = next(x for x in r.records if x.id == "low")
    # preempted at 4000 with a checkpoint at 3600: 400 s x 8 GPUs lost, resumed at 4100
    assert low.preemptions == 1 and low.lost_gpu_seconds == 400 * 8
    assert low.end == 4100 + 7200 - 3600
    assert r.summary["gpu_hours_lost"] == pytest.approx(400 * 8 / 3600)


def test_fairness_and_tenants() -> None:
    assert jain_index([1, 1, 1]) == 1 and jain_index([1, 0, 0]) == pytest.approx(1 / 3)
    tr = Trace("t", "test", [TraceJob(f"{t}{i}", i, 1000, 4, tenant=t)
                             for i in range(20) for t in "ab"])  # fmt: skip
    r = simulate(tr, parse_cluster("1x8"), POLICIES["fair"])
    assert set(r.summary["per_tenant"]) == {"a", "b"}
    assert r.summary["jain_fairness"] > 0.95


def test_a_job_that_can_never_start_is_an_error_not_a_hang() -> None:
    tr = _trace((0, 10, 4))
    with pytest.raises(UserError, match="1 jobs can never start"):
        simulate(tr, parse_cluster("1x8"), POLICIES["kueue"],
                 tenants=[Tenant("default", {"A100-80GB": 2}, borrow=False)])  # fmt: skip


def test_fractional_trace_reports_fgd_fragmentation() -> None:
    ali = load_trace(TRACES / "alibaba_openb_2023/openb_pod_list_default.csv", limit=600)
    nodes = parse_cluster(str(TRACES / "alibaba_openb_2023/openb_node_list_gpu_node.csv"))
    s = simulate(ali, nodes[:40], POLICIES["fifo"].with_(backfill="greedy")).summary
    assert s["jobs"] + s["skipped"] == len(ali.jobs) + sum(ali.skipped.values())
    assert s["fgd_fragmentation_gpus"] >= 0


def test_jobs_no_node_could_host_are_skipped_and_counted() -> None:
    nodes = [
        Node("lean", "H100-SXM", 4, cpu_milli=16000, memory_mib=1024),
        Node("untracked", "H100-SXM", 4),  # never runs out of CPU or memory
    ]
    jobs = [
        TraceJob("fits", 0.0, 60.0, 2, cpu_milli=16000),
        TraceJob("memory-on-untracked", 0.0, 60.0, 4, memory_mib=4096),
        TraceJob("gang-32-cores-per-node", 0.0, 60.0, 8, cpu_milli=64000),  # lean has 16
        TraceJob("gang-4-cores-per-node", 0.0, 60.0, 8, cpu_milli=8000),
    ]
    r = simulate(Trace("t", "gpucloud", jobs), nodes, POLICIES["fifo"])
    assert r.summary["jobs"] == 3
    assert r.skipped == {"more CPU or memory than any node that could hold it has": 1}


def test_a_cambricon_mlu_pool_beside_an_nvidia_one() -> None:
    nodes = parse_cluster("1x8:H100-SXM,1x8:mlu370")
    assert describe(nodes) == "1x8 H100-SXM + 1x8 MLU370-X8" and nodes[1].domain_size == 4
    mlu = ("MLU370-X8",)
    jobs = [TraceJob("h", 0, 50, 8, gpu_types=("H100-SXM",))]
    jobs += [TraceJob(f"m{i}", 0, 100, 4, gpu_types=mlu) for i in range(3)]
    r = simulate(Trace("t", "gpucloud", jobs), nodes, POLICIES["fifo"])
    got = {x.id: (x.first_start, x.end) for x in r.records}
    # the MLU node runs two 4-card gangs at once; the third waits though the H100s free up
    assert got == {"m0": (0, 100), "m1": (0, 100), "m2": (100, 200), "h": (0, 50)}
