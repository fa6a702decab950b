"""`gpucloud train run --profile-steps A:B`: steps A to B recorded with the torch profiler
on rank 0, written as a Chrome trace (it opens in Perfetto, ui.perfetto.dev, and in
chrome://tracing) that `gpucloud doctor --trace FILE` summarises.

Only a few steps are recorded: the profiler slows every op it sees, and a trace of a long
run is too large to open.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from gpucloud.hal import device as hal_device


def trace_path(run_dir: Path, first: int, last: int) -> Path:
    return run_dir / f"profile-steps-{first}-{last}.json"


class StepProfiler:
    """Wraps each optimizer step; records from the start of step `first` to the end of
    step `last` (or the end of the run, if it ends before)."""

    def __init__(self, steps: tuple[int, int] | None, run_dir: Path, backend: str, enabled: bool):
        self.steps = steps if enabled else None
        self.run_dir, self.backend = run_dir, backend
        self._profiler: torch.profiler.profile | None = None

    @contextlib.contextmanager
    def step(self, number: int) -> Iterator[None]:
        """Around step `number` (1-based)."""
        if self.steps is not None and number == self.steps[0]:
            self._profiler = torch.profiler.profile(activities=self._activities())
            self._profiler.__enter__()
        marker = torch.profiler.record_function if self._profiler else contextlib.nullcontext
        with marker(f"step {number}"):
            yield
        if self.steps is not None and number == self.steps[1]:
            self.close()

    def close(self) -> Path | None:
        """Stop recording and write the trace; its path, or None if nothing was recorded."""
        if self._profiler is None:
            return None
        self._profiler.__exit__(None, None, None)
        path = trace_path(self.run_dir, *self.steps)
        self._profiler.export_chrome_trace(str(path))
        self._profiler = None
        return path

    def _activities(self) -> list[torch.profiler.ProfilerActivity]:
        activities = [torch.profiler.ProfilerActivity.CPU]
        extra = hal_device.get_backend(self.backend).profiler_activity
        if extra is not None:
            activities.append(getattr(torch.profiler.ProfilerActivity, extra))
        return activities
