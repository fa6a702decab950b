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

Ray's driver API waits on the head (the GCS) with no deadline of its own, so every call
that needs the head goes through `Bounded` (executors.bounded), HEAD_TIMEOUT seconds at
most. While the head does not answer, every node is unknown (the inventory is empty: the
nodes go DOWN only once not reported for the node timeout), a poll reports its workload
still running (its ranks report to the control plane directly, not through the head), a
start fails with the reason, and what a stop could not release (actors, groups) is
released once the head answers again. One log line when the head stops answering, one when
it answers again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import ray
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from gpucloud.control.config import Settings
from gpucloud.control.executors import check_ray_address
from gpucloud.control.executors.base import (
    Exit,
    Handle,
    Launch,
    NodeInfo,
    StartError,
    WorkloadRef,
)
from gpucloud.control.executors.bounded import Bounded, Unresponsive
from gpucloud.control.executors.ray_launcher import NodeLauncher, Report
from gpucloud.control.executors.ray_nodes import RayNode, answers, death, ray_node
from gpucloud.control.sandbox import scope_for
from gpucloud.errors import ConfigError

log = logging.getLogger(__name__)

NAMESPACE = "gpucloud"
HEAD_TIMEOUT = 5.0  # seconds a call that needs the Ray head may wait for its answer
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
        check_ray_address(address)
        self.logs_dir = settings.logs_dir
        self.scope = scope_for(settings.home)
        self.head = Bounded(f"the Ray head at {address}", HEAD_TIMEOUT)
        self._head_silent = False  # the last call to the head went unanswered
        # releases the head did not answer, each retried once it answers again
        self._leftovers: list[Callable[[], None]] = []
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
        INVENTORY_TTL seconds); none while the head does not answer (all unknown)."""
        if time.monotonic() - self._fetched >= INVENTORY_TTL:
            with contextlib.suppress(Unresponsive):
                self._refresh()
        return list(self._infos)

    def _refresh(self) -> None:
        """Read the nodes from the head. Raises Unresponsive when it does not answer: then
        no node is known until it does."""
        try:
            raws = self.head(ray.nodes)
        except Unresponsive as e:
            self._nodes, self._infos, self._fetched = {}, [], time.monotonic()
            if not self._head_silent:
                log.warning("%s: the Ray cluster's nodes are unknown until it does", e)
            self._head_silent = True
            raise
        if self._head_silent:
            log.warning("%s answers again", self.head.what)
            self._head_silent = False
        nodes: dict[str, tuple[RayNode, NodeInfo]] = {}
        for raw in raws:
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
        leftovers, self._leftovers = self._leftovers, []
        for release in leftovers:  # each one queues itself again if the head goes silent
            release()

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
        """Raises Unresponsive when the node is not known and the head does not answer."""
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
        Raises StartError if the group cannot be placed, or the head does not answer."""
        try:
            return self._start(launch)
        except Unresponsive as e:
            raise StartError(f"{launch.ref} not started: {e}") from None

    def _start(self, launch: Launch) -> Handle:
        nodes = [self._node_of(p.node) for p in launch.parts]
        if any(not p.devices for p in launch.parts):
            raise StartError("every node of a Ray placement needs at least one accelerator")
        _open_log(launch.log_path)
        bundles = [{n.accel: len(p.devices)} for n, p in zip(nodes, launch.parts, strict=True)]
        try:
            group = self.head(
                placement_group,
                bundles,
                strategy="STRICT_SPREAD" if len(bundles) > 1 else "PACK",
                name=str(launch.ref),
                lifetime="detached",
                bundle_label_selector=[{"ray.io/node-id": n.id} for n in nodes],
            )
        except Unresponsive:  # the head may yet make the group: removed once it answers
            self._leftovers.append(partial(self._remove_group_named, str(launch.ref)))
            raise
        try:
            placed = self.head(group.ready)  # its first call registers a function
        except Unresponsive:
            self._release(_Running(group, [], []))
            raise
        ready, _ = ray.wait([placed], timeout=PLACE_TIMEOUT)
        if not ready:
            self._release(_Running(group, [], []))
            where = ", ".join(p.node for p in launch.parts)
            raise StartError(f"Ray could not place {launch.ref} on {where} in {PLACE_TIMEOUT}s")
        actors: list = []
        try:
            for rank, node in enumerate(nodes):
                actors.append(self.head(self._launcher, launch, rank, node, group))
        except Unresponsive:
            self._release(_Running(group, actors, []))
            raise
        self._running[launch.ref] = _Running(group, actors, [n.id for n in nodes])
        return Handle(launch.ref, f"{group.id.hex()}:{len(nodes)}")

    def _launcher(self, launch: Launch, rank: int, node: RayNode, group: PlacementGroup):
        """The launcher actor of node `rank` (named, detached: registered by the head)."""
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
        """None while every rank runs (or some ended well and others still run), or while
        the head does not answer an adoption's questions; else the workload's Exit, once
        every rank is stopped and its group released."""
        try:
            running = self._attach(handle)
        except Unresponsive:
            return None  # as far as anyone knows, still running
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
        release the group (every bundle's resources free again). A workload this executor
        does not know yet is stopped once the head answers, when it does not now."""
        try:
            running = self._attach(handle)
        except Unresponsive as e:
            self._leftovers.append(partial(self.stop, handle, grace))
            return Exit(None, f"{e}: its ranks are stopped once it answers", lost=True)
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
        """The workload's group and actors: known, or found by name (adoption). Raises
        Unresponsive when they must be found and the head does not answer."""
        running = self._running.get(handle.ref)
        if running is not None:
            return running
        group, actors, node_ids = self.head(_find, handle)
        if len(actors) < len(node_ids):  # a rank is gone with its node: stop the others
            stops = [a.stop.remote(0.0) for a in actors]
            if stops:
                ray.wait(stops, num_returns=len(stops), timeout=STOP_MARGIN)
            self._teardown(_Running(group, actors, []))
            return None
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
        does not answer (then the node stays unhealthy in the inventory meanwhile); None
        when none is, or the head does not answer."""
        try:
            self._refresh()
        except Unresponsive:
            return None
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
                with contextlib.suppress(Unresponsive):
                    self._refresh()
                return f"node {node.name} died: {self._silent[node_id]}"
            if not node.alive:
                return f"node {node.name} died"
        return None

    def _teardown(self, running: _Running) -> None:
        """Kill the actors (their ranks already ended) and release the placement group."""
        self._release(running)
        for ref, known in list(self._running.items()):
            if known is running:
                del self._running[ref]

    def _release(self, running: _Running) -> None:
        """Kill the actors and remove the group; once the head answers, if it does not now."""
        try:
            self.head(_kill_and_remove, running.actors, running.group)
        except Unresponsive:
            self._leftovers.append(partial(self._release, running))

    def _remove_group_named(self, name: str) -> None:
        """Remove the group called `name`, if there is one (a start the head did not
        answer in time may yet have made it)."""
        try:
            self.head(_remove_named, name)
        except Unresponsive:
            self._leftovers.append(partial(self._remove_group_named, name))

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


def _find(handle: Handle) -> tuple[PlacementGroup, list, list[str]]:
    """A workload's group, the launcher actors still there (by name), and the node id of
    each bundle, from the head (the actors of a rank whose node died are gone)."""
    group_hex, _, count = handle.token.partition(":")
    group = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_hex)))
    actors = []
    for rank in range(int(count)):
        with contextlib.suppress(ValueError):
            actors.append(ray.get_actor(f"{handle.ref}-node{rank}", namespace=NAMESPACE))
    table = ray.util.placement_group_table(group) if len(actors) == int(count) else {}
    node_ids = [table.get("bundles_to_node_id", {}).get(i, "") for i in range(int(count))]
    return group, actors, node_ids


def _kill_and_remove(actors: list, group: PlacementGroup) -> None:
    for actor in actors:
        with contextlib.suppress(RayError, ValueError):
            ray.kill(actor)
    with contextlib.suppress(RayError, ValueError):
        remove_placement_group(group)


def _remove_named(name: str) -> None:
    with contextlib.suppress(RayError, ValueError):
        remove_placement_group(ray.util.get_placement_group(name))


def _open_log(path: Path) -> None:
    """The workload's log file (0600), made if missing."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o600))
    except OSError as e:
        raise StartError(f"cannot open the log {path}: {e}") from e
