"""What a step's loss and grad norm say about the run, and what to do about it.

Both inputs are already global (all-reduced), so every rank reaches the same verdict
without another collective. fp16 overflow is not a health event: the loss scaler skips
the step and lowers its scale, as dynamic loss scaling always does.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import StrEnum

from gpucloud.train.config import HealthConfig


class Action(StrEnum):
    OK = "ok"
    SKIP = "skip"  # discard this step's update
    ROLLBACK = "rollback"  # reload the last checkpoint and skip this step's data
    STOP = "stop"  # end the run; the launcher exits with STOPPED


@dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str | None = None  # "nan" | "spike" | "overflow"


class HealthMonitor:
    """Flags NaN/inf and grad-norm spikes against a window of recent healthy norms."""

    def __init__(self, cfg: HealthConfig):
        self.cfg = cfg
        self.recent: deque[float] = deque(maxlen=cfg.spike_window)

    def check(self, loss: float, grad_norm: float, overflow_expected: bool = False) -> Verdict:
        if not math.isfinite(loss):
            return Verdict(Action(self.cfg.on_nan), "nan")
        if not math.isfinite(grad_norm):
            if overflow_expected:
                return Verdict(Action.SKIP, "overflow")
            return Verdict(Action(self.cfg.on_nan), "nan")
        if self._is_spike(grad_norm) and self.cfg.on_spike != "ignore":
            return Verdict(Action(self.cfg.on_spike), "spike")
        self.recent.append(grad_norm)
        return Verdict(Action.OK)

    def _is_spike(self, grad_norm: float) -> bool:
        if len(self.recent) < self.recent.maxlen:
            return False
        return grad_norm > self.cfg.spike_factor * (sum(self.recent) / len(self.recent))


class LossScaler:
    """Dynamic loss scaling for fp16: grow ×2 after `interval` clean steps, halve on overflow.

    Works with any strategy because it decides on the global grad norm, which is equal on
    every rank (torch's GradScaler decides per rank, which sharded grads break).
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, interval: int = 2000):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.interval = interval
        self.clean_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.scale / 2, 1.0)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.interval:
            self.scale *= 2
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = state["scale"], state["clean_steps"]
