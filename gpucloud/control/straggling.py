"""A training job's straggling node, as its run reported it.

With `[health] exclude_stragglers = true`, `gpucloud train run` saves a checkpoint and exits
5 once a rank is reported as a straggler; its run's status.json names the rank and its node
(the node's name under the control plane: GPUCLOUD_NODE). The control plane then requeues
the job without that node (`Job.avoid_nodes`, which the scheduler honours), and the next
attempt resumes from the checkpoint elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

STATUS_FILE = "status.json"  # gpucloud.train.launcher's (not imported: it needs torch)
STRAGGLING_NODE_EXIT = 5  # gpucloud.train.launcher.ExitCode.STRAGGLING_NODE


def straggling_node(run_dir: Path | None, placed_on: list[str]) -> tuple[str, str] | None:
    """(node, why) for the straggler the run's status.json names, if it ran on one of the
    nodes the job was placed on; else None (no run dir, no report, an unknown node)."""
    if run_dir is None:
        return None
    try:
        status = json.loads((run_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    found = status.get("straggler") if isinstance(status, dict) else None
    if not isinstance(found, dict) or found.get("host") not in placed_on:
        return None
    node = found["host"]
    why = (
        f"rank {found.get('rank')} on node {node} straggled: {found.get('own_time_s')} s of "
        f"its own work per step against a median of {found.get('peer_median_s')} s"
    )
    return node, why
