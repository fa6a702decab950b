"""The Ray executor: workloads run on the nodes of a Ray cluster (`gpucloud up --executor
ray --ray-address HOST:PORT`; the control plane runs on a node of that cluster, as a Ray
driver).

Nodes: every alive or dead node of the cluster that declares accelerators as a custom
resource `accel_<TYPE>` (executors.ray_nodes).

A workload follows the placement the scheduler core chose: a placement group with one
bundle per node of the placement, each pinned to its node by the node-id label, and on
each bundle a launcher actor (executors.ray_launcher) that runs the command on its node in
that node's sandbox. Group and actors are named after the workload and detached, so they
outlive the control plane's driver: a restarted control plane finds them again from the
handle's token ("<placement group id>:<nodes>") and the names. The actors' output is
fetched on every poll and appended to the workload's log, each line prefixed by its node's
rank when there are several.

Ray does not tear a gang down when one of its nodes dies: a poll that finds a rank's actor
gone or its node dead stops every other rank and releases the group, and reports the
workload lost (requeued without using a retry).

Ray declares a node dead only after its health checks failed for a while (~15 s or more by
default), while the workloads on it notice at once. So when a rank is lost, the executor
tries its node's raylet itself: a node whose raylet does not accept a connection is
reported unhealthy from then on (and no workload is placed there again) until Ray
declares it dead, or its raylet answers again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import ray
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from gpucloud.control.config import Settings
from gpucloud.control.executors.base import (
    Exit,
    Handle,
    Launch,
    NodeInfo,
    StartError,
    WorkloadRef,
)
from gpucloud.control.executors.ray_launcher import NodeLauncher, Report
from gpucloud.control.executors.ray_nodes import RayNode, answers, death, ray_node
from gpucloud.control.sandbox import scope_for
from gpucloud.errors import ConfigError

NAMESPACE = "gpucloud"
INVENTORY_TTL = 2.0  # seconds an inventory is reused (one GCS call per refresh)
PLACE_TIMEOUT = 10.0  # seconds a new placement group may take to be placed
REPORT_WAIT = 0.5  # seconds a poll waits for the ranks' reports
STOP_MARGIN = 10.0  # seconds a stop waits for the ranks beyond their grace
RAYLET_TIMEOUT = 0.5  # seconds a live node's raylet takes at most to accept a connection

_Launcher = ray.remote(NodeLauncher)


@dataclass(slots=True)
class _Running:
    """What the executor knows of one running workload (rebuilt from its token)."""

    group: PlacementGroup
    actors: list
    node_ids: list[str]
    pending: dict[int, ray.ObjectRef] = field(default_factory=dict)  # rank -> report asked


class RayExecutor:
    name = "ray"
    telemetry = None  # device telemetry of its nodes is not read

    def __init__(self, settings: Settings, address: str | None = None) -> None:
        address = address or settings.ray_address
        if not address:
            raise ConfigError("--executor ray needs --ray-address HOST:PORT (Ray's GCS)")
        self.logs_dir = settings.logs_dir
        self.scope = scope_for(settings.home)
        try:
            ray.init(
                address=address,
                namespace=NAMESPACE,
                logging_level=logging.ERROR,
                log_to_driver=False,
                configure_logging=False,
            )
        except (ConnectionError, RayError, ValueError) as e:
            raise ConfigError(f"cannot connect to the Ray cluster at {address}: {e}") from e
        self._nodes: dict[str, RayNode] = {}  # by name
        self._seen: dict[str, tuple[RayNode, NodeInfo]] = {}  # by Ray's node id
        self._infos: list[NodeInfo] = []
        self._fetched = -INVENTORY_TTL
        self._running: dict[WorkloadRef, _Running] = {}
        # nodes Ray still lists alive whose raylet did not answer, by Ray's id: why
        self._silent: dict[str, str] = {}

    # -- nodes

    def inventory(self) -> list[NodeInfo]:
        """Every node with accelerators that Ray knows, alive or dead (refreshed every
        INVENTORY_TTL seconds)."""
        if time.monotonic() - self._fetched >= INVENTORY_TTL:
            self._refresh()
        return list(self._infos)

    def _refresh(self) -> None:
        nodes: dict[str, tuple[RayNode, NodeInfo]] = {}
        for raw in ray.nodes():
            found = ray_node(raw) or self._last_seen(raw)
            if found is None:
                continue
            self._seen[found[0].id] = found
            node, info = self._unless_silent(*found)
            known = nodes.get(node.name)
            if known is None or (node.alive and not known[0].alive):  # the live one wins
                nodes[node.name] = node, info
        self._nodes = {name: node for name, (node, _) in nodes.items()}
        self._infos = [info for _, info in nodes.values()]
        self._fetched = time.monotonic()

    def _unless_silent(self, node: RayNode, info: NodeInfo) -> tuple[RayNode, NodeInfo]:
        """The node as dead while Ray lists it alive but its raylet stays silent; silent no
        more once Ray declares it dead or its raylet answers."""
        why = self._silent.get(node.id)
        if why is None:
            return node, info
        if not node.alive or answers(node.raylet, RAYLET_TIMEOUT):
            del self._silent[node.id]
            return node, info
        return replace(node, alive=False), replace(info, healthy=False, reason=why)

    def _last_seen(self, raw: dict) -> tuple[RayNode, NodeInfo] | None:
        """A dead node as last seen alive: Ray no longer lists a dead node's resources."""
        seen = self._seen.get(raw["NodeID"])
        if seen is None or raw.get("Alive"):
            return None
        node, info = seen
        return replace(node, alive=False), replace(info, healthy=False, reason=death(raw))

    def _node_of(self, name: str) -> RayNode:
        node = self._nodes.get(name)
        if node is None or not node.alive:
            self._refresh()
            node = self._nodes.get(name)
        if node is None or not node.alive:
            raise StartError(f"node {name} is not an alive node of the Ray cluster")
        return node

    # -- workloads

    def start(self, launch: Launch) -> Handle:
        """A placement group with one bundle per part, on the parts' nodes, and a launcher
        actor on each bundle; returns once the group is placed and the actors are created.
        Raises StartError if the group cannot be placed."""
        nodes = [self._node_of(p.node) for p in launch.parts]
        if any(not p.devices for p in launch.parts):
            raise StartError("every node of a Ray placement needs at least one accelerator")
        _open_log(launch.log_path)
        bundles = [{n.accel: len(p.devices)} for n, p in zip(nodes, launch.parts, strict=True)]
        group = placement_group(
            bundles,
            strategy="STRICT_SPREAD" if len(bundles) > 1 else "PACK",
            name=str(launch.ref),
            lifetime="detached",
            bundle_label_selector=[{"ray.io/node-id": n.id} for n in nodes],
        )
        ready, _ = ray.wait([group.ready()], timeout=PLACE_TIMEOUT)
        if not ready:
            remove_placement_group(group)
            where = ", ".join(p.node for p in launch.parts)
            raise StartError(f"Ray could not place {launch.ref} on {where} in {PLACE_TIMEOUT}s")
        actors = [self._launcher(launch, rank, node, group) for rank, node in enumerate(nodes)]
        self._running[launch.ref] = _Running(group, actors, [n.id for n in nodes])
        return Handle(launch.ref, f"{group.id.hex()}:{len(nodes)}")

    def _launcher(self, launch: Launch, rank: int, node: RayNode, group: PlacementGroup):
        name = f"{launch.ref}-node{rank}"
        with contextlib.suppress(ValueError):  # a previous attempt's, not yet gone
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        part = launch.parts[rank]
        # log and exit files are replaced by files of the launcher's own on the node
        spec = launch.sandbox_spec(
            name, {**launch.env, **part.env}, launch.log_path, launch.log_path
        )
        return _Launcher.options(
            name=name,
            namespace=NAMESPACE,
            lifetime="detached",
            max_restarts=0,
            num_cpus=0,
            resources={node.accel: len(part.devices)},
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, rank),
        ).remote(self.scope, spec)

    def poll(self, handle: Handle) -> Exit | None:
        """None while every rank runs (or some ended well and others still run); else the
        workload's Exit, once every rank is stopped and its group released."""
        running = self._attach(handle)
        if running is None:
            return Exit(None, "its Ray actors are gone", lost=True)
        reports, lost = self._reports(running, REPORT_WAIT)
        self._append(handle.ref, running, reports)
        failed = [r for _, r in sorted(reports.items()) if r.ended and (r.code or r.error)]
        done = not running.pending and all(r.ended for r in reports.values())
        if lost is None and not failed and not done:
            return None
        self._end(handle.ref, running, grace=0.0)
        if lost is not None:
            return Exit(None, lost, lost=True)
        return Exit(failed[0].code, failed[0].error) if failed else Exit(0)

    def stop(self, handle: Handle, grace: float) -> Exit:
        """SIGTERM every rank on every node, SIGKILL after `grace`; kill the actors and
        release the group (every bundle's resources free again)."""
        running = self._attach(handle)
        if running is None:
            return Exit(None, "its Ray actors were gone", lost=True)
        reports = self._end(handle.ref, running, grace)
        codes = [r.code for _, r in sorted(reports.items()) if r.code]
        return Exit(codes[0] if codes else (0 if reports else None))

    def _end(self, ref: WorkloadRef, running: _Running, grace: float) -> dict[int, Report]:
        """Stop every rank still running (SIGKILL after `grace`), log their last output,
        kill the actors and release the group; the ranks' last reports."""
        reports = self._stop_ranks(running, grace)
        self._append(ref, running, reports)
        self._teardown(running)
        return reports

    def close(self) -> None:
        """Disconnect this driver; the detached groups and actors keep running."""
        ray.shutdown()

    # -- helpers

    def _attach(self, handle: Handle) -> _Running | None:
        """The workload's group and actors: known, or found by name (adoption)."""
        running = self._running.get(handle.ref)
        if running is not None:
            return running
        group_hex, _, count = handle.token.partition(":")
        group = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_hex)))
        actors = []
        for rank in range(int(count)):
            with contextlib.suppress(ValueError):
                actors.append(ray.get_actor(f"{handle.ref}-node{rank}", namespace=NAMESPACE))
        if len(actors) < int(count):  # a rank is gone with its node: stop the others
            stops = [a.stop.remote(0.0) for a in actors]
            if stops:
                ray.wait(stops, num_returns=len(stops), timeout=STOP_MARGIN)
            self._teardown(_Running(group, actors, []))
            return None
        table = ray.util.placement_group_table(group)
        node_ids = [table.get("bundles_to_node_id", {}).get(i, "") for i in range(int(count))]
        running = self._running[handle.ref] = _Running(group, actors, node_ids)
        return running

    def _reports(self, running: _Running, wait: float) -> tuple[dict[int, Report], str | None]:
        """The reports the ranks gave within `wait` seconds, and why the workload is lost
        (a rank's actor or node gone), if it is. A rank that does not answer in time is
        asked again by the next poll; its pending answer is kept, never dropped."""
        for rank, actor in enumerate(running.actors):
            if rank not in running.pending:
                running.pending[rank] = actor.report.remote()
        reports, failed = self._collect(running, wait)
        lost = None
        if failed or running.pending:
            lost = self._dead_node(running)
        if lost is None and failed:
            rank = min(failed)
            lost = f"the launcher of node rank {rank} on {self._name(running, rank)} died"
        return reports, lost

    def _name(self, running: _Running, rank: int) -> str:
        """The name of the node `rank` runs on, as the inventory gives it."""
        by_id = {n.id: n.name for n in self._nodes.values()}
        node_id = running.node_ids[rank]
        return by_id.get(node_id) or f"ray-{node_id[:12]}"

    def _stop_ranks(self, running: _Running, grace: float) -> dict[int, Report]:
        """Ask every rank to stop (after any report it still owes); the reports of those
        that answered."""
        stops = {rank: actor.stop.remote(grace) for rank, actor in enumerate(running.actors)}
        reports, _ = self._collect(running, grace + STOP_MARGIN)
        running.pending = stops
        last, _ = self._collect(running, grace + STOP_MARGIN)
        for rank, report in last.items():
            before = reports.get(rank, Report(b""))
            reports[rank] = replace(report, output=before.output + report.output)
        running.pending = {}
        return reports

    def _collect(self, running: _Running, wait: float) -> tuple[dict[int, Report], set[int]]:
        """Wait up to `wait` seconds for the pending answers; those received, by rank, and
        the ranks whose actor is gone."""
        refs = list(running.pending.values())
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=wait)
        reports, failed = {}, set()
        for rank, ref in list(running.pending.items()):
            if not ray.wait([ref], timeout=0)[0]:
                continue
            del running.pending[rank]
            try:
                reports[rank] = ray.get(ref)
            except RayError:
                failed.add(rank)
        return reports, failed

    def _dead_node(self, running: _Running) -> str | None:
        """'node X died' if a node of the workload is dead in Ray's state, or its raylet
        does not answer (then the node stays unhealthy in the inventory meanwhile)."""
        self._refresh()
        by_id = {n.id: n for n in self._nodes.values()}
        for node_id in running.node_ids:
            node = by_id.get(node_id)
            if node is None:
                continue
            if node.alive and not answers(node.raylet, RAYLET_TIMEOUT):
                host, port = node.raylet
                self._silent[node_id] = (
                    f"its raylet at {host}:{port} does not answer (Ray has not declared the "
                    "node dead yet)"
                )
                self._refresh()
                return f"node {node.name} died: {self._silent[node_id]}"
            if not node.alive:
                return f"node {node.name} died"
        return None

    def _teardown(self, running: _Running) -> None:
        """Kill the actors (their ranks already ended) and release the placement group."""
        for actor in running.actors:
            with contextlib.suppress(RayError, ValueError):
                ray.kill(actor)
        with contextlib.suppress(RayError, ValueError):
            remove_placement_group(running.group)
        for ref, known in list(self._running.items()):
            if known is running:
                del self._running[ref]

    def _append(self, ref: WorkloadRef, running: _Running, reports: dict[int, Report]) -> None:
        """Append the ranks' new output to the workload's log, prefixed by node rank when
        there are several nodes."""
        chunks = [(rank, r.output) for rank, r in sorted(reports.items()) if r.output]
        if not chunks:
            return
        several = len(running.actors) > 1
        with (self.logs_dir / f"{ref}.log").open("ab") as out:
            for rank, output in chunks:
                if several:
                    prefix = f"[node {rank}] ".encode()
                    output = b"".join(prefix + line for line in output.splitlines(keepends=True))
                out.write(output)


def _open_log(path: Path) -> None:
    """The workload's log file (0600), made if missing."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o600))
    except OSError as e:
        raise StartError(f"cannot open the log {path}: {e}") from e
