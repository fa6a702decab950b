"""The size of the object-storage cache: entries held while used, and the least recently
used of the others evicted beyond a cap.

`storage.local_copy` fetches a URL's objects into an entry of the cache (a directory named
after their fingerprint). A process that uses an entry holds it until it exits: a shared
flock on the entry's lock file (ENTRY.lock beside it), taken before the entry is read or
fetched. An eviction takes that lock exclusively without waiting, so it never removes an
entry that a running workload (a replica, a training run) reads through memory maps.

Each use stamps the entry's mtime. After a fetch grew the cache, the least recently used
entries that no process holds are removed until the cache fits its cap again:
$GPUCLOUD_STORAGE_CACHE_MAX_GB (GiB, default 100; `gpucloud up --storage-cache-max-gb`
sets it for the control plane's workloads). An entry in use stays, even beyond the cap.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import shutil
from pathlib import Path

from gpucloud.errors import UserError

MAX_GB_ENV = "GPUCLOUD_STORAGE_CACHE_MAX_GB"
DEFAULT_MAX_GB = 100.0
PART = ".part-"  # in the name of a fetch under way (storage._download)

_held: dict[Path, int] = {}  # entry -> its lock file's fd, locked until this process ends


def max_bytes() -> int:
    """The cache's cap. Raises UserError for a value of MAX_GB_ENV that is no size."""
    text = os.environ.get(MAX_GB_ENV, "").strip()
    if not text:
        return int(DEFAULT_MAX_GB * 2**30)
    try:
        gb = float(text)
    except ValueError:
        gb = math.nan
    if not (gb >= 0 and math.isfinite(gb)):
        raise UserError(f"{MAX_GB_ENV}={text!r} is not a size: give GiB as a number >= 0, e.g. 50")
    return int(gb * 2**30)


def hold(entry: Path) -> None:
    """Hold `entry` (fetched or about to be) until this process exits; stamp it used."""
    if entry not in _held:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd = _lock(entry, fcntl.LOCK_SH)
        assert fd is not None  # a blocking lock
        _held[entry] = fd
    with contextlib.suppress(FileNotFoundError):
        os.utime(entry)


def trim(cache: Path) -> list[Path]:
    """Remove the least recently used entries of `cache` that no process holds until it
    fits its cap; the entries removed."""
    cap = max_bytes()
    entries = [p for p in cache.iterdir() if p.is_dir() and PART not in p.name]
    sizes = {entry: _size(entry) for entry in entries}
    total = sum(sizes.values())
    removed = []
    for entry in sorted(entries, key=_used_at):
        if total <= cap:
            break
        if entry in _held or (fd := _lock(entry, fcntl.LOCK_EX | fcntl.LOCK_NB)) is None:
            continue  # in use
        try:
            shutil.rmtree(entry, ignore_errors=True)
            _lock_path(entry).unlink(missing_ok=True)
        finally:
            os.close(fd)
        total -= sizes[entry]
        removed.append(entry)
    return removed


def _lock(entry: Path, how: int) -> int | None:
    """An fd of the entry's lock file, locked `how`; None when LOCK_NB found it locked.
    A lock file an eviction removed meanwhile is made anew and locked again."""
    path = _lock_path(entry)
    while True:
        # read-only, 0644: users who share a cache can all lock each other's entries
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, how)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _lock_path(entry: Path) -> Path:
    return entry.with_name(entry.name + ".lock")


def _used_at(entry: Path) -> float:
    try:
        return entry.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _size(entry: Path) -> int:
    total = 0
    for root, _, files in os.walk(entry):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total
