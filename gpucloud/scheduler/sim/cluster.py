"""Cluster specs for simulation: "16x8", "16x8:A100-80GB,4x8:Ascend-910B", "16x8/4" (two
4-GPU link domains per node), or a CSV node list with a `gpu` column (Alibaba's)."""

from __future__ import annotations

import csv
import re
from pathlib import Path

from gpucloud.errors import ConfigError
from gpucloud.scheduler.state import ClusterState, Node

NODES_PER_RACK = 4  # racks (top-of-rack switches) hold this many nodes, in node order
_PART = re.compile(r"^(\d+)x(\d+)(?:/(\d+))?(?::(.+))?$")


def parse_cluster(spec: str, gpu: str = "A100-80GB") -> list[Node]:
    """Nodes for `spec` (see module doc); `gpu` is the type of parts that name none.

    Raises ConfigError naming the part that cannot be read.
    """
    if Path(spec).suffix == ".csv":
        return _from_csv(Path(spec), gpu)
    nodes: list[Node] = []
    for part in spec.replace(" ", "").split(","):
        m = _PART.match(part)
        if not m:
            raise ConfigError(
                f"cluster part {part!r}: write NODESxGPUS, optionally with /DOMAIN and :TYPE "
                "(e.g. 16x8, 4x8/4:H100-SXM), or give a .csv node list"
            )
        count, per, domain, kind = int(m[1]), int(m[2]), int(m[3] or 0), m[4] or gpu
        if count < 1 or per < 1:
            raise ConfigError(f"cluster part {part!r}: nodes and GPUs per node must be >= 1")
        for _ in range(count):
            i = len(nodes)
            nodes.append(Node(f"node-{i:04d}", kind, per, domain, f"rack-{i // NODES_PER_RACK}"))
    return nodes


def _from_csv(path: Path, gpu: str) -> list[Node]:
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise ConfigError(f"cannot read node list {path}: {e.strerror}") from None
    if not rows or "gpu" not in rows[0]:
        raise ConfigError(f"node list {path} needs a 'gpu' column (GPUs per node)")
    nodes: list[Node] = []
    for line, row in enumerate(rows, start=2):
        try:
            n = int(row["gpu"])
        except ValueError:
            raise ConfigError(f"{path} row {line}: gpu {row['gpu']!r} is not a count") from None
        if n > 0:
            i = len(nodes)
            name = row.get("sn") or f"node-{i:04d}"
            host = [_count(path, line, row, col) for col in ("cpu_milli", "memory_mib")]
            nodes.append(Node(name, gpu, n, 0, f"rack-{i // NODES_PER_RACK}", *host))
    return nodes


def _count(path: Path, line: int, row: dict, col: str) -> int:
    """An optional whole number >= 0 of a node list row (0 = not given)."""
    v = (row.get(col) or "").strip()
    if not v:
        return 0
    if not v.isdigit():
        raise ConfigError(f"{path} row {line}: {col} {v!r} must be a whole number >= 0")
    return int(v)


def describe(nodes: list[Node]) -> str:
    """A short text like '20x8 A100-80GB' or '16x8 A100-80GB + 4x8 Ascend-910B'."""
    groups: dict[tuple[str, int], int] = {}
    for n in nodes:
        groups[(n.gpu_type, n.num_gpus)] = groups.get((n.gpu_type, n.num_gpus), 0) + 1
    return " + ".join(f"{c}x{g} {t}" for (t, g), c in groups.items())


def empty_state(nodes: list[Node], default_estimate: float = 3600.0) -> ClusterState:
    """A cluster state holding fresh, idle copies of `nodes` (a replay never changes the
    caller's nodes)."""
    state = ClusterState(default_estimate=default_estimate)
    for n in nodes:
        state.add_node(
            Node(n.name, n.gpu_type, n.num_gpus, n.domain_size, n.rack, n.cpu_milli, n.memory_mib)
        )
    return state
