"""The Ray executor on a real Ray cluster: a head and two worker nodes with two fake A100s
each, on a private loopback (tests/control/ray_cluster.py). Run alone with `pytest -m ray`.

The tests share one cluster; the last one kills a worker node.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import pytest
import ray
from cli_run import run_cli
from ray.util.placement_group import PlacementGroup

from gpucloud import hardware
from gpucloud.control.config import Settings
from gpucloud.control.executors.base import (
    Exit,
    Handle,
    Launch,
    NodeInfo,
    NodePart,
    StartError,
    WorkloadRef,
)
from gpucloud.control.executors.ray import NAMESPACE, RayExecutor
from gpucloud.control.sandbox import Identity, Sandbox, scope_for
from gpucloud.errors import ConfigError

from .conftest import wait_for
from .ray_cluster import RayCluster, own_network, worker_address

pytestmark = pytest.mark.ray

UID = 62950  # the tenant user the workloads run as


@dataclass
class Plane:
    """A control plane's side: its home, a tenant's area, and its Ray executor."""

    cluster: RayCluster
    settings: Settings
    area: Path
    executor: RayExecutor

    def restart(self) -> None:
        """A new executor, as a restarted control plane makes (the old driver gone)."""
        self.executor.close()
        self.executor = RayExecutor(self.settings, self.cluster.address)


@pytest.fixture(scope="module")
def plane(tmp_path_factory) -> Iterator[Plane]:
    home = tmp_path_factory.mktemp("home")
    area = home / "tenants" / "t"
    area.mkdir(parents=True)
    os.chown(area, UID, UID)
    with own_network():
        cluster = RayCluster(workers=2, gpus=2, gpu_type="A100")
        try:
            cluster.start()
            settings = Settings(home=home)
            plane = Plane(cluster, settings, area, RayExecutor(settings, cluster.address))
            yield plane
            plane.executor.close()
        finally:
            cluster.stop()
            Sandbox(scope_for(home)).close()


def _workers(executor: RayExecutor) -> list[NodeInfo]:
    return sorted(executor.inventory(), key=lambda n: n.name)


def _launch(plane: Plane, job_id: int, command: str, nodes: list[NodeInfo]) -> Launch:
    ref = WorkloadRef.job(job_id)
    parts = tuple(
        NodePart(
            n.name,
            n.address,
            (0,),
            {"GPUCLOUD_NODE_RANK": str(i), "GPUCLOUD_NNODES": str(len(nodes))},
        )
        for i, n in enumerate(nodes)
    )
    return Launch(
        ref=ref,
        command=command,
        env={"JOB": str(ref)},
        cwd=plane.area,
        log_path=plane.settings.logs_dir / f"{ref}.log",
        parts=parts,
        identity=Identity(UID, UID),
        writable=(plane.area,),
        hidden=(plane.settings.home,),
    )


def _ended(executor: RayExecutor, handle: Handle, timeout: float = 60.0) -> Exit:
    return wait_for(lambda: executor.poll(handle), timeout=timeout, interval=0.2)


def _free_accelerators() -> float:
    return ray.available_resources().get("accel_A100", 0.0)


def test_inventory_reports_the_worker_nodes_with_their_accelerators(plane):
    nodes = _workers(plane.executor)
    assert len(nodes) == 2  # the head declares no accelerators: not a node of ours
    assert len({n.name for n in nodes}) == 2
    assert sorted(n.address for n in nodes) == [worker_address(0), worker_address(1)]
    for n in nodes:
        assert (n.gpu_type, n.gpus, n.backend) == (hardware.get("A100").name, 2, "cpu")
        assert (n.cpu_milli, n.memory_mib) == (4000, 8192)
        assert n.labels == {"role": "worker"}
        assert n.healthy and n.reason is None


def test_two_node_job_runs_a_rank_on_each_node_and_logs_both(plane):
    nodes = _workers(plane.executor)
    command = "echo rank $GPUCLOUD_NODE_RANK of $GPUCLOUD_NNODES in $JOB; echo done"
    launch = _launch(plane, 1, command, nodes)
    handle = plane.executor.start(launch)

    assert _ended(plane.executor, handle) == Exit(0)
    lines = launch.log_path.read_text().splitlines()
    assert sorted(lines) == [
        "[node 0] done",
        "[node 0] rank 0 of 2 in job-1",
        "[node 1] done",
        "[node 1] rank 1 of 2 in job-1",
    ]
    wait_for(lambda: _free_accelerators() == 4)  # its group released


def test_a_failing_rank_stops_the_others_and_gives_its_code(plane):
    nodes = _workers(plane.executor)
    command = 'if [ "$GPUCLOUD_NODE_RANK" = 1 ]; then echo failing; exit 3; fi; exec sleep 600'
    handle = plane.executor.start(_launch(plane, 2, command, nodes))

    assert _ended(plane.executor, handle) == Exit(3)
    assert "[node 1] failing" in (plane.settings.logs_dir / "job-2.log").read_text()
    assert _running_ranks(plane, "job-2", 2) == []
    wait_for(lambda: _free_accelerators() == 4)


def test_one_node_job_logs_unprefixed_and_says_why_it_could_not_start(plane):
    nodes = _workers(plane.executor)[:1]
    launch = _launch(plane, 7, "echo never", nodes)
    launch = replace(launch, cwd=Path("/proc/no/such/dir"))  # its user cannot make it
    handle = plane.executor.start(launch)

    ended = _ended(plane.executor, handle)
    assert ended.code == 125 and not ended.lost
    assert ended.reason.startswith("could not start: gpucloud sandbox:")
    assert _log(launch).startswith("gpucloud sandbox:")  # one node: no rank prefix
    wait_for(lambda: _free_accelerators() == 4)


def test_stop_ends_every_rank_and_frees_every_bundle(plane):
    nodes = _workers(plane.executor)
    launch = _launch(plane, 3, "echo started; exec sleep 600", nodes)
    handle = plane.executor.start(launch)
    wait_for(lambda: plane.executor.poll(handle) is None and "[node 1] started" in _log(launch))
    placed = ray.util.placement_group_table(_group(handle))["bundles_to_node_id"]
    # each bundle on the node the placement named, holding one of its accelerators
    assert [placed[i][:12] for i in (0, 1)] == [n.name.removeprefix("ray-") for n in nodes]
    assert _free_accelerators() == 2

    plane.executor.stop(handle, grace=1.0)

    assert _running_ranks(plane, "job-3", 2) == []
    wait_for(lambda: _free_accelerators() == 4)
    assert ray.util.placement_group_table(_group(handle))["state"] == "REMOVED"
    for rank in (0, 1):
        with pytest.raises(ValueError):
            ray.get_actor(f"job-3-node{rank}", namespace=NAMESPACE)


def test_a_restarted_control_plane_adopts_a_running_job(plane):
    nodes = _workers(plane.executor)
    launch = _launch(plane, 4, "echo before; exec sleep 600", nodes)
    handle = plane.executor.start(launch)
    wait_for(lambda: plane.executor.poll(handle) is None and _log(launch).count("before") == 2)

    plane.restart()
    adopted = Handle(handle.ref, handle.token)  # as rebuilt from the store

    assert plane.executor.poll(adopted) is None
    assert plane.executor.stop(adopted, grace=1.0).lost is False
    assert _running_ranks(plane, "job-4", 2) == []
    wait_for(lambda: _free_accelerators() == 4)


def test_a_rank_dies_with_its_launcher(plane):
    """A launcher actor that dies (crashed, or its worker process killed) on a node that
    stays up takes its rank along: nothing keeps running that no one reports."""
    nodes = _workers(plane.executor)[:1]
    launch = _launch(plane, 8, "echo started; exec sleep 600", nodes)
    handle = plane.executor.start(launch)
    wait_for(lambda: plane.executor.poll(handle) is None and "started" in _log(launch))
    cgroups = Sandbox(scope_for(plane.settings.home)).cgroups
    assert cgroups is not None
    [rank, *_] = cgroups.members("job-8-node0")
    launcher = next(  # the actor's worker process: Ray titles it after the actor's class
        p for p in psutil.Process(rank).parents() if " ".join(p.cmdline()).startswith("ray::Node")
    )

    launcher.kill()

    assert _running_ranks(plane, "job-8", 1) == []
    assert _ended(plane.executor, handle).lost
    wait_for(lambda: _free_accelerators() == 4)


def test_a_ray_client_address_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """Ray Client (ray://) needs the ray[client] extra, which gpucloud does not install."""
    with pytest.raises(ConfigError, match=r"^--ray-address ray://127.0.0.1:10001: Ray Client"):
        RayExecutor(Settings(home=tmp_path), "ray://127.0.0.1:10001")
    monkeypatch.setenv("GPUCLOUD_HOME", str(tmp_path))
    up = ["up", "--executor", "ray", "--ray-address", "ray://head:10001"]
    out = run_cli(capsys, monkeypatch, *up)
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.count("\n") == 1 and "give the head's GCS address HOST:PORT" in out.stderr


def test_start_on_an_unknown_node_is_refused(plane):
    node = NodeInfo("nowhere", "A100-80GB", 2, "cpu", "127.0.0.1")
    with pytest.raises(StartError, match="nowhere is not an alive node"):
        plane.executor.start(_launch(plane, 5, "true", [node]))


def test_a_dead_node_ends_the_job_as_lost_and_shows_unhealthy(plane):
    """Last: it kills a worker node for good."""
    nodes = _workers(plane.executor)
    launch = _launch(plane, 6, "echo up; exec sleep 600", nodes)
    handle = plane.executor.start(launch)
    wait_for(lambda: plane.executor.poll(handle) is None and _log(launch).count("up") == 2)
    node_id = ray.util.placement_group_table(_group(handle))["bundles_to_node_id"][1]
    victim = next(n for n in plane.cluster.nodes if n.node_id() == node_id)

    victim.kill_raylet()

    ended = _ended(plane.executor, handle, timeout=30)
    assert ended.lost and ended.code is None
    # Ray may notice the launcher's end before it declares its node dead: then the executor
    # finds the node's raylet silent itself
    assert ended.reason.startswith(f"node {nodes[1].name} died"), ended.reason
    assert _running_ranks(plane, "job-6", 2) == []  # the survivor's rank stopped
    wait_for(lambda: _free_accelerators() == 2)  # the live node's bundle released
    dead = [n for n in plane.executor.inventory() if not n.healthy]  # at once
    assert [n.name for n in dead] == [nodes[1].name]
    assert dead[0].reason.startswith(
        ("Ray reports the node dead", f"its raylet at {nodes[1].address}:")
    )
    wait_for(  # Ray's word, once it has it
        lambda: [n.reason for n in plane.executor.inventory() if not n.healthy][0].startswith(
            "Ray reports the node dead"
        )
    )
    Sandbox(scope_for(plane.settings.home)).finish("job-6-node1", 0)  # the dead machine's


def _log(launch: Launch) -> str:
    return launch.log_path.read_text() if launch.log_path.exists() else ""


def _group(handle: Handle) -> PlacementGroup:
    return PlacementGroup(ray.PlacementGroupID(bytes.fromhex(handle.token.partition(":")[0])))


def _running_ranks(plane: Plane, ref: str, nodes: int) -> list[int]:
    """The host pids still in the ranks' sandboxes (cgroups) of workload `ref`."""
    cgroups = Sandbox(scope_for(plane.settings.home)).cgroups
    assert cgroups is not None
    deadline = time.monotonic() + 10
    while (pids := [p for r in range(nodes) for p in cgroups.members(f"{ref}-node{r}")]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    return pids
