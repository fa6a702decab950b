"""Reading a workload's log file, once or following it until the workload ends."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

CHUNK = 64 * 1024


def read(path: Path, tail_bytes: int | None = None) -> bytes:
    """The file's bytes (the last `tail_bytes` of them if given); empty if it does not exist."""
    try:
        with path.open("rb") as f:
            if tail_bytes is not None:
                f.seek(0, 2)
                f.seek(max(f.tell() - tail_bytes, 0))
            return f.read()
    except FileNotFoundError:
        return b""


def follow(path: Path, finished: Callable[[], bool], poll: float = 0.25) -> Iterator[bytes]:
    """Yield the file's bytes as they are written until `finished()` and nothing is left.

    `finished` is asked only after the file had nothing new, so the last lines a workload
    wrote before it ended are never lost.
    """
    offset = 0
    while True:
        data = read_from(path, offset)
        if data:
            offset += len(data)
            yield data
            continue
        if finished():
            data = read_from(path, offset)
            if data:
                yield data
            return
        time.sleep(poll)


def read_from(path: Path, offset: int) -> bytes:
    """Up to CHUNK bytes of the file from `offset`; empty if there are none (or no file)."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read(CHUNK)
    except FileNotFoundError:
        return b""
