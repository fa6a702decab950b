"""Durations as people type them: 90s, 15m, 24h, 7d."""

from __future__ import annotations

import re

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


_PART = r"(\d+(?:\.\d+)?)([smhd])"


def parse_duration(text: str) -> float | None:
    """Seconds in `text` ("90s", "2h", "1h30m"), or None when it is not numbers with units."""
    text = text.strip()
    if not re.fullmatch(f"(?:{_PART})+", text):
        return None
    return sum(float(n) * _UNITS[unit] for n, unit in re.findall(_PART, text))


def format_duration(seconds: float) -> str:
    """`seconds` as people write it, whole units down to the second: 90 -> '1m30s',
    7200 -> '2h', 0.4 -> '0.4s'."""
    if seconds < 60 and seconds != int(seconds):
        return f"{seconds:g}s"
    rest, parts = round(seconds), []
    for unit in ("d", "h", "m", "s"):
        count, rest = divmod(rest, _UNITS[unit])
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts) or "0s"
