"""FGD fragmentation, FGD placement and workload inflation (`gpucloud sim inflate`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpucloud.errors import ConfigError
from gpucloud.scheduler import ClusterState, Job, Node, PlacementConfig
from gpucloud.scheduler.fgd import Workload, fgd_fragmentation
from gpucloud.scheduler.placement import place
from gpucloud.scheduler.sim.cluster import parse_cluster
from gpucloud.scheduler.sim.inflate import inflate
from gpucloud.scheduler.sim.traces import Trace, TraceJob, load_trace
from scheduler.helpers import check_invariants

GPUCLOUD = str(Path(sys.executable).with_name("gpucloud"))
GPU = "A100-80GB"


def _trace(*classes: tuple[int, int]) -> Trace:
    jobs = [TraceJob(f"p{i}", float(i), 60.0, n, m) for i, (n, m) in enumerate(classes)]
    return Trace("pods", "gpucloud", jobs)


def _state(*gpus: int) -> ClusterState:
    state = ClusterState()
    for i, g in enumerate(gpus):
        state.add_node(Node(f"n{i}", GPU, g, 1))
    return state


def _place_all(state: ClusterState, cfg: PlacementConfig, millis: list[int]) -> list[str | None]:
    """Place 1-GPU pods of these shares in order; the node each went to (None = failed)."""
    where: list[str | None] = []
    for i, milli in enumerate(millis):
        job = Job(f"j{len(state.jobs)}-{i}", gpu_milli=milli)
        alloc = place(state, job, GPU, cfg)
        if alloc is not None:
            state.submit(job)
            state.start(job, alloc, 0.0)
        where.append(alloc.nodes[0] if alloc else None)
    check_invariants(state)
    return where


def test_fragmentation_follows_the_paper_definition() -> None:
    state = _state(4)
    state.start(
        state.submit(Job("a", gpu_milli=700)), place(state, Job("x", gpu_milli=700), GPU), 0
    )
    state.start(state.submit(Job("b")), place(state, Job("y"), GPU), 0)
    assert sorted(state.node_list[0].free_milli) == [0, 300, 1000, 1000]
    mix = Workload.of([(1, 500), (2, 1000), (4, 1000), (4, 1000)])
    # 500-milli tasks: the 300 left on a GPU; 2-GPU tasks fit, so the partly used GPU's 300;
    # 4-GPU tasks (weight 2) do not fit: all 2,300 free. (300 + 300 + 2 x 2300) / 4 classes.
    assert fgd_fragmentation(state, mix) == 1.3


def test_fgd_keeps_room_that_best_fit_strands() -> None:
    """Two 1-GPU nodes, pods of 0.2 and 0.7 GPU: best fit stacks the two small pods on
    one GPU, so the second 0.7 fits nowhere; FGD puts them apart and every pod fits."""
    mix = Workload.of([(1, 200), (1, 700)])
    millis = [200, 200, 700, 700]
    pack_state, fgd_state = _state(1, 1), _state(1, 1)
    pack = _place_all(pack_state, PlacementConfig("pack"), millis[:2])
    fgd = _place_all(fgd_state, PlacementConfig("fgd", workload=mix), millis[:2])
    assert (pack, fgd) == (["n0", "n0"], ["n0", "n1"])
    # best fit left 0.6 GPU that a 0.7 pod cannot use: 600 milli x 1 class of 2
    assert (fgd_fragmentation(pack_state, mix), fgd_fragmentation(fgd_state, mix)) == (0.3, 0.0)
    assert _place_all(pack_state, PlacementConfig("pack"), millis[2:]) == ["n1", None]
    assert _place_all(fgd_state, PlacementConfig("fgd", workload=mix), millis[2:]) == ["n0", "n1"]


def test_fgd_needs_a_workload_and_leaves_the_avoided_node_alone() -> None:
    with pytest.raises(ConfigError, match="fgd needs a workload"):
        PlacementConfig("fgd")
    state = _state(1, 2)
    cfg = PlacementConfig("fgd", workload=Workload.of([(1, 1000), (2, 1000)]))
    job = Job("j")
    alloc = place(state, job, GPU, cfg)
    assert alloc is not None and alloc.nodes == ("n0",)  # keeps n1's two GPUs together
    alloc = place(state, job, GPU, cfg, avoid=0)
    assert alloc is not None and alloc.nodes == ("n1",)


@pytest.mark.parametrize("placement", ["pack", "fgd"])
def test_pods_that_fit_nowhere_are_counted_as_failed(placement: str) -> None:
    """0.6-GPU pods on 8 GPUs: 13 arrive (7.8 GPUs; a 14th would pass capacity), one fits
    per GPU, the other 5 fail; every GPU keeps 0.4 that no pod can use."""
    r = inflate(_trace((1, 600)), parse_cluster("4x2"), placement, seed=3)
    end = r.curve[-1]
    assert (r.capacity, r.pods, r.failed_pods) == (8, 13, 5)
    assert end.arrived == pytest.approx(7.8 / 8)
    assert (end.allocated_gpus, end.failed_gpus) == (pytest.approx(4.8), pytest.approx(3.0))
    assert end.fragmented_gpus == pytest.approx(3.2) and end.fragmentation_rate == 1.0
    assert end.failure_share == pytest.approx(3.0 / 7.8)
    assert r.at(0.5).failed_gpus == 0.0 and r.at(0.5).arrived <= 0.5


@pytest.mark.parametrize("placement", ["pack", "spread", "fgd"])
def test_the_curve_is_monotone_in_arrived_workload(placement: str) -> None:
    trace = _trace((1, 1000), (1, 500), (1, 250), (1, 810), (2, 1000), (4, 1000), (8, 1000))
    nodes = parse_cluster("2x8,6x2,2x4")
    r = inflate(trace, nodes, placement, seed=7, until=1.2)
    assert r.curve[0].arrived == 0.0 and r.curve[-1].arrived <= 1.2
    for a, b in zip(r.curve, r.curve[1:], strict=False):
        assert a.arrived < b.arrived
        assert a.allocated_gpus <= b.allocated_gpus and a.failed_gpus <= b.failed_gpus
    for p in r.curve:
        assert p.allocated_gpus + p.failed_gpus == pytest.approx(p.arrived * r.capacity)
        assert p.allocated_gpus <= r.capacity and 0 <= p.fragmentation_rate <= 1
    assert r.failed_pods > 0  # 120% of capacity arrived
    assert inflate(trace, nodes, placement, seed=7, until=1.2) == r


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [GPUCLOUD, "sim", "inflate", *args], capture_output=True, text=True, timeout=120
    )


def _csv(tmp_path: Path) -> Path:
    path = tmp_path / "pods.csv"
    rows = ["id,submit_time,duration,num_gpus,gpu_milli"]
    rows += [f"p{i},{i},60,{n},{m}" for i, (n, m) in enumerate([(1, 300), (1, 1000), (2, 1000)])]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_cli_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "report"
    done = _cli("--trace", str(_csv(tmp_path)), "--cluster", "3x4", "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert [d["placement"] for d in data] == ["pack", "fgd"]
    for d in data:
        assert d["capacity_gpus"] == 12 and d["cluster"] == "3x4 A100-80GB"
        assert set(d["at"]) == {"0.5", "0.7", "0.9", "1"}
        assert set(d["end"]) == {"arrived", "allocated_gpus", "failed_gpus", "fragmented_gpus",
                                 "fragmentation_rate", "failure_share"}  # fmt: skip
        assert d["pods"] == data[0]["pods"] and len(d["curve"]) > 10
    assert (out / "inflation.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_bad_values_exit_2(tmp_path: Path) -> None:
    trace = str(_csv(tmp_path))
    for args, msg in (
        (["--placement", "pack,fgdd"], "choose pack, spread or fgd"),
        (["--until", "0"], "until must be > 0"),
    ):
        done = _cli("--trace", trace, "--cluster", "2x4", *args)
        assert done.returncode == 2, done.stderr
        assert msg in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_node_out_of_cpu_strands_its_free_gpus() -> None:
    """FGD counts a node's free GPUs as fragmented for a task class whose CPU or memory the
    node lacks; FGD placement therefore keeps CPU where GPUs are left, best fit does not."""
    mix = Workload.of([(1, 1000, 12000, 0), (1, 1000, 2000, 0)])

    def cluster() -> ClusterState:
        state = ClusterState()
        state.add_node(Node("small", GPU, 2, 1, cpu_milli=16000))
        state.add_node(Node("big", GPU, 2, 1, cpu_milli=64000))
        return state

    pack_state, fgd_state = cluster(), cluster()
    pod = Job("p", cpu_milli=12000)
    at = {}
    for name, state, cfg in (
        ("pack", pack_state, PlacementConfig("pack")),
        ("fgd", fgd_state, PlacementConfig("fgd", workload=mix)),
    ):
        alloc = place(state, pod, GPU, cfg)
        state.start(state.submit(Job(f"{name}-p", cpu_milli=12000)), alloc, 0.0)
        at[name] = alloc.nodes[0]
        check_invariants(state)
    assert at == {"pack": "small", "fgd": "big"}
    # small has 1 GPU and 4 cores left: the 12-core class cannot use its GPU (1 of 2 classes)
    assert fgd_fragmentation(pack_state, mix) == 0.5
    assert fgd_fragmentation(fgd_state, mix) == 0.0
    # and no placement ever puts a second 12-core pod on the small node
    assert place(pack_state, Job("q", cpu_milli=12000), GPU).nodes == ("big",)


def test_inflation_reads_cpu_and_memory_of_pods_and_nodes(tmp_path: Path) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,8000,65536,2,T4\n")
    pods = tmp_path / "pods.csv"
    pods.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,"
        "deletion_time,scheduled_time\np0,6000,1024,1,500,,LS,Running,0,100,0\n"
    )
    trace = load_trace(pods)
    assert (trace.jobs[0].cpu_milli, trace.jobs[0].memory_mib) == (6000, 1024)
    cluster = parse_cluster(str(nodes))
    assert (cluster[0].cpu_milli, cluster[0].memory_mib) == (8000, 65536)
    # 2 GPUs of room but 8 cores: only one 6-core, half-GPU pod ever fits
    r = inflate(trace, cluster, "pack", seed=0)
    assert (r.pods, r.failed_pods) == (4, 3)
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,eight,65536,2,T4\n")
    with pytest.raises(ConfigError, match="row 2: cpu_milli 'eight' must be a whole number"):
        parse_cluster(str(nodes))
