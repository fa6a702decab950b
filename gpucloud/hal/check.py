"""One line of `gpucloud doctor`: a check's status and what to do about it."""

from __future__ import annotations

from dataclasses import asdict, dataclass

OK, WARN, FAIL = "OK", "WARN", "FAIL"


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: str  # OK | WARN | FAIL
    detail: str
    fix: str | None = None  # what to do, for WARN and FAIL
    measured: dict[str, float] | None = None  # the figures behind `detail`, in bytes and seconds

    def to_json(self) -> dict:
        return asdict(self)
