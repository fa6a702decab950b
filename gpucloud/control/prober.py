"""Replica probes, off the reconciler's thread: /ready while a replica starts, /health once
it is READY.

Each pass the reconciler hands over the replicas it loaded (`submit`) and takes the verdicts
that came back since the last pass (`collect`); the HTTP calls run in worker threads with no
database session open, so a replica that stops answering never holds up a pass. A READY
replica is probed every `interval` seconds and must answer within as long; it is declared
dead after `failures` failed probes in a row, or at once when its engine loop died (its
/health says "engine failed": that never heals).
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import httpx

_WORKERS = 8  # probes in flight at once; each waits at most `interval` seconds
_ENGINE_DEAD = "engine failed"  # gpucloud serve's /health status once its engine loop died


@dataclass(frozen=True, slots=True)
class Target:
    """One run of a replica: a restarted replica (new `started_at`) is a new target."""

    replica: int
    started_at: float
    url: str  # http://its node's address:its port
    ready: bool  # READY: probe its health; else (STARTING) whether it is ready yet


@dataclass(frozen=True, slots=True)
class _Answer:
    ok: bool
    why: str = ""
    fatal: bool = False  # the server says it cannot recover


class Prober:
    def __init__(self, interval: float, failures: int) -> None:
        self.interval, self.failures = interval, failures
        # One client for every probe: a new one builds a TLS context (~40 ms CPU).
        self._http = httpx.Client(timeout=interval)
        self._pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="probe")
        self._running: dict[Target, Future[_Answer]] = {}
        self._last: dict[Target, float] = {}  # when each live target was last probed
        self._misses: dict[Target, int] = {}  # failed health probes in a row

    def submit(self, targets: list[Target], now: float) -> None:
        """Probe each of `targets` (every replica alive now) that has no probe running and
        is due: a starting one at once, a ready one `interval` s after its last probe."""
        live = set(targets)
        for gone in set(self._last) - live:
            del self._last[gone]
            self._misses.pop(gone, None)
        for t in targets:
            due = not t.ready or now - self._last.get(t, -math.inf) >= self.interval
            if due and t not in self._running:
                self._last[t] = now
                self._running[t] = self._pool.submit(self._probe, t)

    def collect(self) -> tuple[list[Target], dict[Target, str]]:
        """The probes finished since the last call: starting replicas found ready, and
        ready ones found dead, each with the reason."""
        ready: list[Target] = []
        dead: dict[Target, str] = {}
        for t, future in list(self._running.items()):
            if not future.done():
                continue
            del self._running[t]
            answer = future.result()
            if not t.ready:
                if answer.ok:
                    ready.append(t)
            elif answer.ok:
                self._misses.pop(t, None)
            elif answer.fatal:
                dead[t] = answer.why
            else:
                misses = self._misses[t] = self._misses.get(t, 0) + 1
                if misses >= self.failures:
                    dead[t] = f"{misses} health probes failed in a row, the last: {answer.why}"
        return ready, dead

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def _probe(self, t: Target) -> _Answer:
        url = t.url
        path = "/health" if t.ready else "/ready"
        try:
            r = self._http.get(url + path)
            if r.status_code == 404 and t.ready:  # a custom server's one duty is /ready
                path = "/ready"
                r = self._http.get(url + path)
        except httpx.TimeoutException:
            return _Answer(False, f"{path} did not answer within {self.interval:g} s")
        except httpx.HTTPError as e:
            return _Answer(False, f"{path} failed: {str(e) or type(e).__name__}")
        if r.status_code == 200:
            return _Answer(True)
        status = _status(r)
        why = f"{path} answered {r.status_code}" + (f" ({status})" if status else "")
        return _Answer(False, why, fatal=status == _ENGINE_DEAD)


def _status(r: httpx.Response) -> str | None:
    try:
        body = r.json()
    except ValueError:
        return None
    status = body.get("status") if isinstance(body, dict) else None
    return status if isinstance(status, str) else None
