from __future__ import annotations

import pytest

from gpucloud.errors import CapacityError, UserError
from gpucloud.scheduler import Allocation, ClusterState, Job, Node, PlacementConfig
from gpucloud.scheduler.placement import place
from scheduler.helpers import check_invariants, cluster


def _occupy(state, job_id: str, node: str, gpus: tuple[int, ...]) -> None:
    job = state.submit(Job(job_id, num_gpus=len(gpus)))
    state.start(job, Allocation("H100-SXM", ((node, gpus),)), 0)


def test_pack_picks_the_fullest_node_and_spread_the_emptiest() -> None:
    state = cluster(3)
    _occupy(state, "a", "n1", (0, 1, 2, 3, 4))
    job = Job("j", num_gpus=2)
    assert place(state, job, "H100-SXM").nodes == ("n1",)
    assert place(state, job, "H100-SXM", PlacementConfig("spread")).nodes in (("n0",), ("n2",))


def test_a_job_is_never_placed_on_a_node_it_avoids() -> None:
    """A training job restarted without its straggling node: every strategy, and a gang
    spanning nodes, leaves the node out; with no other room the job waits."""
    state = cluster(3)
    _occupy(state, "a", "n1", (0, 1, 2, 3, 4))  # best fit for 2 GPUs: n1
    job = Job("j", num_gpus=2, avoid_nodes=frozenset({"n1"}))
    assert place(state, job, "H100-SXM").nodes in (("n0",), ("n2",))
    assert "n0" not in place(state, Job("s", num_gpus=2, avoid_nodes=frozenset({"n0"})), "H100-SXM",
                             PlacementConfig("spread")).nodes  # fmt: skip
    wide = Job("w", num_gpus=11, avoid_nodes=frozenset({"n0"}))  # n1 (3 free) + n2 (8)
    assert set(place(state, wide, "H100-SXM").nodes) == {"n1", "n2"}
    assert place(state, Job("x", num_gpus=12, avoid_nodes=frozenset({"n0"})), "H100-SXM") is None


def test_a_job_stays_inside_one_link_domain_when_it_fits() -> None:
    state = cluster(1, domain=4)  # two 4-GPU domains
    _occupy(state, "a", "n0", (0, 5))  # 3 free in each domain
    assert place(state, Job("j", num_gpus=3), "H100-SXM").parts[0][1] in ((1, 2, 3), (4, 6, 7))
    _occupy(state, "b", "n0", (1,))  # domain 0 has 2 free, domain 1 has 3
    assert place(state, Job("k", num_gpus=2), "H100-SXM").parts[0][1] == (2, 3)


def test_a_gang_on_an_mlu370_node_stays_inside_one_mlu_link_bridge() -> None:
    state = ClusterState()
    state.add_node(Node("m0", "mlu370", 8))  # two bridges of 4 cards, from the catalog
    state.start(state.submit(Job("a", num_gpus=1)), Allocation("MLU370-X8", (("m0", (0,)),)), 0)
    assert place(state, Job("j", num_gpus=4), "MLU370-X8").parts == (("m0", (4, 5, 6, 7)),)


def test_a_large_gang_spans_the_fewest_nodes() -> None:
    state = cluster(4)
    _occupy(state, "a", "n0", (0, 1, 2, 3, 4, 5))  # n0 has 2 free
    alloc = place(state, Job("j", num_gpus=10), "H100-SXM")
    assert alloc.num_gpus == 10 and len(alloc.parts) == 2
    assert "n0" in alloc.nodes  # the 2-GPU remainder goes to the best-fit node


def test_consolidate_keeps_small_jobs_on_one_node() -> None:
    state = cluster(2)
    _occupy(state, "a", "n0", (0, 1, 2, 3, 4))
    _occupy(state, "b", "n1", (0, 1, 2, 3, 4))
    job = Job("j", num_gpus=4)
    assert len(place(state, job, "H100-SXM").parts) == 2
    assert place(state, job, "H100-SXM", PlacementConfig(consolidate=True)) is None


def test_fraction_goes_to_the_tightest_shared_gpu() -> None:
    state = cluster(1, gpus=4)
    for i, (gpu, milli) in enumerate(((0, 500), (1, 800))):
        j = state.submit(Job(f"s{i}", gpu_milli=milli))
        state.start(j, Allocation("H100-SXM", (("n0", (gpu,)),), milli), 0)
    assert place(state, Job("f", gpu_milli=200), "H100-SXM").parts == (("n0", (1,)),)
    assert place(state, Job("g", gpu_milli=400), "H100-SXM").parts == (("n0", (0,)),)
    assert place(state, Job("h", gpu_milli=600), "H100-SXM").parts[0][1][0] in (2, 3)


def test_a_gang_larger_than_a_node_spans_the_fewest_racks() -> None:
    state = cluster(6)  # two nodes per rack: rack-0 = n0 n1, rack-1 = n2 n3, rack-2 = n4 n5
    _occupy(state, "a", "n1", (0, 1, 2, 3))  # rack-0: 12 free
    _occupy(state, "b", "n4", (0, 1, 2, 3, 4, 5))  # rack-2: 10 free; rack-1: 16 free
    rack = {n.name: n.rack for n in state.node_list}

    def racks(g: int) -> set[str]:
        alloc = place(state, Job(f"g{g}", num_gpus=g), "H100-SXM")
        assert alloc.num_gpus == g
        return {rack[n] for n in alloc.nodes}

    assert racks(12) == {"rack-0"}  # the best-fit rack, not the emptiest nodes
    assert racks(16) == {"rack-1"}
    assert racks(20) == {"rack-1", "rack-2"}  # the fullest rack, then best fit for 4
    assert len(racks(38)) == 3


def test_jobs_go_only_where_the_node_has_their_cpu_and_memory() -> None:
    state = ClusterState()
    state.add_node(Node("lean", "H100-SXM", 8, cpu_milli=8000, memory_mib=65536))
    state.add_node(Node("fat", "H100-SXM", 8, cpu_milli=96000, memory_mib=1 << 20))
    # best fit would pick either (both empty); lean lacks the cores
    assert place(state, Job("a", num_gpus=2, cpu_milli=16000), "H100-SXM").nodes == ("fat",)
    assert place(state, Job("b", num_gpus=2, memory_mib=1 << 17), "H100-SXM").nodes == ("fat",)
    assert place(state, Job("c", num_gpus=2, cpu_milli=4000), "H100-SXM").nodes == ("lean",)
    # a gang over two nodes holds its requests in proportion to its GPUs on each
    gang = Job("g", num_gpus=16, cpu_milli=32000)
    assert gang.host_share(8) == (16000, 0)
    assert place(state, gang, "H100-SXM") is None  # lean cannot hold 8 GPUs' 16 cores
    assert place(state, Job("h", num_gpus=16, cpu_milli=16000), "H100-SXM") is not None
    with pytest.raises(UserError, match="cpu_milli and memory_mib must be >= 0"):
        Job("bad", cpu_milli=-1)


def test_starting_where_the_cpu_is_gone_is_refused() -> None:
    state = ClusterState()
    state.add_node(Node("n", "H100-SXM", 2, cpu_milli=4000))
    first = state.submit(Job("a", cpu_milli=3000))
    state.start(first, place(state, first, "H100-SXM"), 0.0)
    assert state.nodes["n"].free_cpu == 1000
    second = state.submit(Job("b", cpu_milli=3000))
    assert place(state, second, "H100-SXM") is None  # a GPU is free, the cores are not
    with pytest.raises(CapacityError, match="lacks the CPU or memory"):
        state.start(second, Allocation("H100-SXM", (("n", (1,)),)), 0.0)
    state.finish(first, 10.0)
    assert state.nodes["n"].free_cpu == 4000
    check_invariants(state)
