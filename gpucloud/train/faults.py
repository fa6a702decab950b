"""Fault injection for drills and tests (`[fault]`): a rank that dies, lags or hangs.

Each fault fires on the first attempt only, so the restarted group shows the recovery.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from gpucloud.train.config import FaultConfig

log = logging.getLogger(__name__)


class Faults:
    def __init__(self, cfg: FaultConfig, rank: int, attempt: int):
        self.cfg, self.rank = cfg, rank
        self.armed = attempt == 0

    def lag(self) -> None:
        """A straggler's forward pass: `slow_rank` sleeps `slow_seconds`."""
        if self.armed and self.cfg.slow_rank == self.rank:
            time.sleep(self.cfg.slow_seconds)

    def hang_before(self, step: int) -> None:
        """`hang_rank` stops before `hang_at_step`, until the hang watchdog ends the process."""
        if self.armed and self.cfg.hang_at_step == step and self.cfg.hang_rank == self.rank:
            log.warning("fault injection: rank %d stops before step %d", self.rank, step)
            threading.Event().wait()

    def kill_after(self, step: int) -> None:
        """`kill_rank` SIGKILLs itself right after `kill_at_step`."""
        if self.armed and self.cfg.kill_at_step == step and self.cfg.kill_rank == self.rank:
            log.warning("fault injection: SIGKILL rank %d after step %d", self.rank, step)
            os.kill(os.getpid(), signal.SIGKILL)
