"""`gpucloud doctor --trace FILE`: the ops a torch profiler trace (Chrome/Perfetto JSON, as
`gpucloud train run --profile-steps` writes it) spent its time in, by self time.

An op's self time is its duration less that of the ops it called (the complete events
nested in it on the same thread), so time is counted once: `aten::linear` does not also
count the `aten::addmm` inside it. Host ops (cpu_op) and device kernels (kernel) are ranked
together; each row says which it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gpucloud.errors import ConfigError

_KINDS = {"cpu_op": "host", "kernel": "device", "gpu_op": "device"}


@dataclass(frozen=True, slots=True)
class OpTime:
    name: str
    kind: str  # host | device
    calls: int
    self_seconds: float
    share: float  # of the self time of every op of its kind


def read_events(path: Path) -> list[dict]:
    """The complete ("X") op events of a trace. Raises ConfigError for what is not one."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read trace {path}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"{path} is not a JSON trace: {e}") from None
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise ConfigError(f"{path} has no traceEvents: not a Chrome/Perfetto trace")
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in _KINDS and "dur" in e]


def top_ops(events: list[dict], limit: int = 10) -> list[OpTime]:
    """The `limit` ops with the most self time, most first."""
    self_us = _self_times(events)
    totals: dict[tuple[str, str], list[float]] = {}
    for e, own in zip(events, self_us, strict=True):
        totals.setdefault((e["name"], _KINDS[e["cat"]]), []).append(own)
    by_kind: dict[str, float] = {}
    for (_, kind), times in totals.items():
        by_kind[kind] = by_kind.get(kind, 0.0) + sum(times)
    ops = [
        OpTime(name, kind, len(times), sum(times) / 1e6, sum(times) / (by_kind[kind] or 1))
        for (name, kind), times in totals.items()
    ]
    return sorted(ops, key=lambda o: o.self_seconds, reverse=True)[:limit]


def _self_times(events: list[dict]) -> list[float]:
    """Each event's duration less its direct children's, in microseconds."""
    own = [float(e["dur"]) for e in events]
    # per lane by start; of two starting together, the longer (the caller) first
    order = sorted(
        range(len(events)), key=lambda i: (_lane(events[i]), events[i]["ts"], -events[i]["dur"])
    )
    stack: list[int] = []  # open events of the current lane, outermost first
    lane = None
    for i in order:
        e = events[i]
        if _lane(e) != lane:
            stack, lane = [], _lane(e)
        while stack and events[stack[-1]]["ts"] + events[stack[-1]]["dur"] <= e["ts"]:
            stack.pop()
        if stack:
            own[stack[-1]] -= e["dur"]
        stack.append(i)
    return [max(t, 0.0) for t in own]


def _lane(e: dict) -> tuple[str, str]:
    return str(e.get("pid")), str(e.get("tid"))
