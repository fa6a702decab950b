"""The vendors' command-line tools (nvidia-smi, npu-smi), read when they are installed."""

from __future__ import annotations

import shutil
import subprocess


def nvidia_driver_version() -> str | None:
    """The driver version nvidia-smi reports, or None without nvidia-smi or a GPU."""
    out = tool(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def tool(argv: list[str]) -> str | None:
    """A vendor tool's output, or None when it is not installed or fails."""
    if not shutil.which(argv[0]):
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 and done.stdout.strip() else None
