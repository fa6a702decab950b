"""Durations as people type them: 90s, 15m, 24h, 7d."""

from __future__ import annotations

import re

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float | None:
    """Seconds in `text`, or None when it is not a number with a unit."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    return float(m.group(1)) * _UNITS[m.group(2)] if m else None
