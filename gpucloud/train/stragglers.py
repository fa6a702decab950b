"""Stragglers and hangs: which rank holds the others back, said out loud.

A straggler: every step each rank times its own work (reading its batches and its forward
passes: no collective runs there under DDP, so a fast rank's figure does not include waiting
for a slow one) and the figures travel with the step's loss all-reduce, one slot per rank.
A rank whose figure exceeds `straggler_factor` × the median of its peers' (and
`MIN_EXCESS_S` more, so scheduler noise on tiny steps is not news) for `straggler_steps`
consecutive steps is reported once, until it recovers. Under FSDP the forward's all-gathers
make peers wait for a slow rank, so there only a slow input pipeline shows.

A hang: a watchdog thread gives each step `hang_timeout_s`. Past it, the step is stuck in
a collective that a peer never joined (or in the peer itself); every rank's watchdog fires.
Each rank marks in the rendezvous store how far it got (step started, forward done), so the
report names the ranks that fell behind, with their hosts. The process then exits with
`HUNG_EXIT`, which makes torchrun restart the group from the last checkpoint (within
`launch.max_restarts`) and the launcher exit 4.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from statistics import median

import torch
import torch.distributed as dist

from gpucloud.train.config import HealthConfig

log = logging.getLogger(__name__)

MIN_EXCESS_S = 0.05
STORE_TIMEOUT_S = 10  # for reading the ranks' progress after a hang
HUNG_EXIT = 4  # the worker's exit code after a hang (launcher.ExitCode.HUNG is the same)
STARTED, FORWARD_DONE = 0, 1  # how far a rank got in a step, as marked in the store


@dataclass(frozen=True)
class Straggler:
    step: int
    rank: int
    host: str
    own_time_s: float
    peer_median_s: float

    def record(self) -> dict:
        times = {"own_time_s": round(self.own_time_s, 4),
                 "peer_median_s": round(self.peer_median_s, 4)}  # fmt: skip
        return {"event": "straggler", **asdict(self), **times}

    def message(self, steps: int) -> str:
        return (
            f"rank {self.rank} on host {self.host} is a straggler: {self.own_time_s:.3f} s of "
            f"own work per step against a median of {self.peer_median_s:.3f} s among its "
            f"peers, for {steps} consecutive steps"
        )


def slow_ranks(times: list[float], factor: float) -> list[tuple[int, float]]:
    """(rank, median of its peers) for each rank above factor × that median (+ the floor)."""
    slow = []
    for rank, own in enumerate(times):
        peers = median(times[:rank] + times[rank + 1 :])
        if own > factor * peers and own - peers > MIN_EXCESS_S:
            slow.append((rank, peers))
    return slow


class StragglerDetector:
    """Pure bookkeeping over each step's per-rank times: no clock, no collectives."""

    def __init__(self, factor: float, steps: int, hosts: list[str]):
        self.factor, self.steps, self.hosts = factor, steps, hosts
        self.streak = [0] * len(hosts)
        self.reported: set[int] = set()

    def observe(self, step: int, times: list[float]) -> tuple[list[Straggler], list[int]]:
        """The ranks that just became stragglers, and those that just stopped being one."""
        slow = dict(slow_ranks(times, self.factor))
        found, recovered = [], []
        for rank in range(len(times)):
            self.streak[rank] = self.streak[rank] + 1 if rank in slow else 0
            if self.streak[rank] >= self.steps and rank not in self.reported:
                self.reported.add(rank)
                found.append(Straggler(step, rank, self.hosts[rank], times[rank], slow[rank]))
            elif rank not in slow and rank in self.reported:
                self.reported.discard(rank)
                recovered.append(rank)
        return found, recovered


class Heartbeats:
    """Each rank's progress ("STEP PHASE HOST") under its own key of the rendezvous store."""

    def __init__(self, store, rank: int, world_size: int, host: str):
        self.store, self.rank, self.world_size, self.host = store, rank, world_size, host

    def mark(self, step: int, phase: int) -> None:
        self.store.set(f"gpucloud/progress/{self.rank}", f"{step} {phase} {self.host}")

    def behind(self) -> list[tuple[int, str, int, int]]:
        """(rank, host, step, phase) of every rank behind the furthest one; a rank that never
        marked counts as step 0."""
        seen = []
        for rank in range(self.world_size):
            key = f"gpucloud/progress/{rank}"
            if self.store.check([key]):
                step, phase, host = self.store.get(key).decode().split(" ", 2)
                seen.append((rank, host, int(step), int(phase)))
            else:
                seen.append((rank, "?", 0, STARTED))
        furthest = max((s, p) for _, _, s, p in seen)
        return [r for r in seen if (r[2], r[3]) < furthest]


class HangWatchdog:
    """A daemon thread that calls `on_hang(step)` once when a step outlives `timeout_s`."""

    def __init__(self, timeout_s: float, on_hang: Callable[[int], None]):
        self.timeout_s, self.on_hang = timeout_s, on_hang
        self._deadline: float | None = None
        self._step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._thread.start()

    def start_step(self, step: int) -> None:
        self._step, self._deadline = step, time.monotonic() + self.timeout_s

    def end_step(self) -> None:
        self._deadline = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        interval = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(interval):
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                self.on_hang(self._step)
                return


def hang_report(step: int, timeout_s: float, behind: list[tuple[int, str, int, int]]) -> dict:
    """The metrics record of a hang at `step`."""
    return {
        "step": step,
        "event": "hang",
        "timeout_s": timeout_s,
        "behind_ranks": [rank for rank, *_ in behind],
        "behind_hosts": [host for _, host, *_ in behind],
    }


def hang_message(step: int, timeout_s: float, behind: list[tuple[int, str, int, int]]) -> str:
    phase = {STARTED: "started", FORWARD_DONE: "finished the forward of"}
    if not behind:
        who = "no rank is behind the others: a collective itself did not complete"
    else:
        who = "; ".join(
            f"rank {rank} on host {host} last {phase[p]} step {s}" for rank, host, s, p in behind
        )
    return (
        f"step {step} did not finish within {timeout_s:g} s (health.hang_timeout_s): {who}; "
        f"exiting with code {HUNG_EXIT} (retryable: the next attempt resumes from the last "
        "checkpoint)"
    )


def exit_hung() -> None:
    """Leave at once: the main thread is stuck in a collective that will not return."""
    logging.shutdown()
    os._exit(HUNG_EXIT)


class RankWatch:
    """One rank's part: its heartbeats, its watchdog, and (when steps are timed: no
    pipeline, where stages differ by design) the straggler verdicts every rank agrees on."""

    def __init__(
        self,
        cfg: HealthConfig,
        rank: int,
        world_size: int,
        store,
        timed: bool,
        report: Callable[[dict], None],
    ):
        self.cfg, self.rank, self.world_size, self.report = cfg, rank, world_size, report
        self.enabled = world_size > 1
        hosts = [socket.gethostname()] * world_size
        if self.enabled:
            dist.all_gather_object(hosts, socket.gethostname())
        self.detector = StragglerDetector(cfg.straggler_factor, cfg.straggler_steps, hosts)
        self.timed = timed and self.enabled
        self.heartbeats = (
            Heartbeats(store, rank, world_size, hosts[rank])
            if self.enabled and store is not None
            else None
        )
        self.watchdog = HangWatchdog(cfg.hang_timeout_s, self._hung) if self.enabled else None

    def start_step(self, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.start_step(step)
        self._mark(step, STARTED)

    def forward_done(self, step: int) -> None:
        self._mark(step, FORWARD_DONE)

    def end_step(self) -> None:
        if self.watchdog is not None:
            self.watchdog.end_step()

    def slots(self, own_time_s: float) -> torch.Tensor:
        """This rank's time in its own slot, zeros elsewhere: summed over ranks by the step's
        all-reduce, every rank gets every rank's time. Empty when steps are not timed."""
        slots = torch.zeros(self.world_size if self.timed else 0, dtype=torch.float64)
        if self.timed:
            slots[self.rank] = own_time_s
        return slots

    def observe(self, step: int, times: list[float]) -> list[dict]:
        """Records of the stragglers found and recovered at `step` (each logged here)."""
        if not self.timed:
            return []
        found, recovered = self.detector.observe(step, times)
        if self.rank == 0:  # every rank reaches the same verdicts: one says them
            for s in found:
                log.warning(s.message(self.cfg.straggler_steps))
            for rank in recovered:
                log.info("rank %d on host %s is no longer a straggler (step %d)", rank,
                         self.detector.hosts[rank], step)  # fmt: skip
        back = [{"step": step, "event": "straggler_recovered", "rank": r} for r in recovered]
        return [s.record() for s in found] + back

    @property
    def stragglers(self) -> int:
        return len(self.detector.reported)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()

    def _mark(self, step: int, phase: int) -> None:
        if self.heartbeats is not None:
            self.heartbeats.mark(step, phase)

    def _hung(self, step: int) -> None:
        try:
            behind = self._behind()
            timeout = self.cfg.hang_timeout_s
            log.error(hang_message(step, timeout, behind))
            self.report(hang_report(step, timeout, behind))
        finally:
            exit_hung()

    def _behind(self) -> list[tuple[int, str, int, int]]:
        if self.heartbeats is None:
            return []
        # The store may be gone with the node that hosted it: do not hang in the report.
        self.heartbeats.store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
        try:
            return self.heartbeats.behind()
        except RuntimeError as e:  # torch's DistStoreError among them
            log.error("cannot read the ranks' progress from the rendezvous store: %s", e)
            return []
