"""The console's server-side sessions: an opaque id in the browser's cookie, the API key
behind it kept in this process only.

A session id is 32 random bytes; the map is keyed by its SHA-256, so the ids themselves
are not kept either. A session ends at logout, after IDLE seconds without a request, after
LIFETIME seconds in any case, and as soon as its key stops working or is rotated (the
caller ends it: `end_key`). At most MAX_SESSIONS live at once: past that, the oldest ends.

Sessions live in the memory of one control-plane process: a restart logs every browser
out, and several control planes behind one address need sticky routing for the console.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

IDLE = 2 * 3600.0  # seconds without a request that end a session
LIFETIME = 12 * 3600.0  # seconds after which a session ends however busy
MAX_SESSIONS = 10_000


@dataclass(slots=True)
class _Session:
    key: str
    opened: float
    seen: float


def _hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


class Sessions:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._live: dict[str, _Session] = {}  # id hash -> session, oldest first
        self._lock = threading.Lock()

    def open(self, key: str) -> str:
        """A new session acting with `key` (already checked): its id, for the cookie."""
        session_id = secrets.token_urlsafe(32)
        now = self.clock()
        with self._lock:
            self._purge(now)
            while len(self._live) >= MAX_SESSIONS:
                del self._live[next(iter(self._live))]
            self._live[_hash(session_id)] = _Session(key, now, now)
        return session_id

    def key(self, session_id: str | None) -> str | None:
        """The key of a live session (its idle time restarts), or None."""
        if not session_id:
            return None
        now = self.clock()
        h = _hash(session_id)
        with self._lock:
            s = self._live.get(h)
            if s is None:
                return None
            if now - s.seen >= IDLE or now - s.opened >= LIFETIME:
                del self._live[h]
                return None
            s.seen = now
            return s.key

    def close(self, session_id: str | None) -> None:
        """End a session (logout); an unknown id is ignored."""
        if session_id:
            with self._lock:
                self._live.pop(_hash(session_id), None)

    def end_key(self, key: str) -> None:
        """End every session acting with `key` (it was revoked or rotated)."""
        with self._lock:
            for h in [h for h, s in self._live.items() if s.key == key]:
                del self._live[h]

    def __len__(self) -> int:
        return len(self._live)

    def _purge(self, now: float) -> None:
        for h in [
            h for h, s in self._live.items() if now - s.seen >= IDLE or now - s.opened >= LIFETIME
        ]:
            del self._live[h]
