"""Trace loaders: public GPU-cluster traces (and our own CSV format) into `Trace`.

The format is recognised from the CSV header:

| format    | needed columns                                              | tenant      |
|-----------|-------------------------------------------------------------|-------------|
| gpucloud  | id, submit_time, duration, num_gpus (+ tenant, estimate,    | tenant      |
|           | priority, gpu_milli, gpu_type, preemptible, cpu_milli,      |             |
|           | memory_mib)                                                 |             |
| itp       | job_id, submission_time, duration, num_gpu (Microsoft ITP)  | "default"   |
| philly    | timestamp, duration, num_gpus, cluster (Pollux's Philly)    | the VC      |
| tiresias  | job_id, num_gpu, submit_time, duration (Tiresias 60 jobs)   | "default"   |
| alibaba   | name, num_gpu, gpu_milli, creation_time, deletion_time,     | qos class   |
|           | scheduled_time, pod_phase (+ cpu_milli, memory_mib)         |             |
|           | (Alibaba openb 2023)                                        |             |

Submit times are shifted so the first kept job arrives at 0. A row that cannot be read
(missing or non-numeric value, negative duration) is an error naming the file and row.
Rows that are valid but cannot be replayed (an Alibaba pod with no GPU or never scheduled)
are skipped and counted by reason in `Trace.skipped`.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from gpucloud.errors import ConfigError, unknown_name


@dataclass(frozen=True, slots=True)
class TraceJob:
    id: str
    submit_time: float
    duration: float
    num_gpus: int
    gpu_milli: int = 1000
    tenant: str = "default"
    estimate: float | None = None
    priority: int = 0
    gpu_types: tuple[str, ...] = ()
    preemptible: bool = True
    cpu_milli: int = 0  # host resources asked for besides GPUs (0 = none)
    memory_mib: int = 0


@dataclass(slots=True)
class Trace:
    name: str
    format: str
    jobs: list[TraceJob]
    skipped: Counter = field(default_factory=Counter)

    @property
    def tenants(self) -> list[str]:
        return sorted({j.tenant for j in self.jobs})


_FORMATS: dict[str, set[str]] = {
    "gpucloud": {"id", "submit_time", "duration", "num_gpus"},
    "itp": {"job_id", "submission_time", "duration", "num_gpu"},
    "philly": {"timestamp", "duration", "num_gpus", "cluster"},
    "tiresias": {"job_id", "num_gpu", "submit_time", "duration"},
    "alibaba": {
        "name",
        "num_gpu",
        "gpu_milli",
        "creation_time",
        "deletion_time",
        "scheduled_time",
        "pod_phase",
    },
}


def detect_format(columns: list[str]) -> str:
    """The trace format whose columns are all present. Raises ConfigError otherwise,
    naming the closest format and the columns it misses."""
    cols = set(columns)
    for name, needed in _FORMATS.items():
        if needed <= cols:
            return name
    closest = max(_FORMATS, key=lambda n: len(_FORMATS[n] & cols) / len(_FORMATS[n]))
    missing = ", ".join(sorted(_FORMATS[closest] - cols))
    raise ConfigError(
        f"unrecognised trace columns ({', '.join(columns)}): closest format is {closest}, "
        f"which also needs {missing}"
    )


def load_trace(path: str | Path, vc: str | None = None, limit: int | None = None) -> Trace:
    """Read a trace file. `vc` keeps one Philly virtual cluster; `limit` keeps the first
    `limit` jobs by submit time. Raises ConfigError for unreadable files or rows."""
    p = Path(path)
    try:
        with p.open(newline="") as f:
            reader = csv.DictReader(f)
            fmt = detect_format(list(reader.fieldnames or []))
            if vc is not None and fmt != "philly":
                raise ConfigError(f"--vc selects a Philly virtual cluster; {p} is a {fmt} trace")
            rows = list(reader)
    except OSError as e:
        raise ConfigError(f"cannot read trace {p}: {e.strerror}") from None
    parse = _PARSERS[fmt]
    jobs: list[TraceJob] = []
    skipped: Counter = Counter()
    for i, row in enumerate(rows, start=2):  # row 1 is the header
        job = parse(_Row(p, i, row), skipped)
        if job is not None and (vc is None or job.tenant == vc):
            jobs.append(job)
    if vc is not None and not jobs:
        vcs = sorted({r["cluster"] for r in rows})
        raise unknown_name("Philly virtual cluster", vc, vcs)
    jobs.sort(key=lambda j: j.submit_time)
    if limit is not None:
        jobs = jobs[:limit]
    t0 = jobs[0].submit_time if jobs else 0.0
    jobs = [_shift(j, t0) for j in jobs]
    name = p.stem + (f"-{vc}" if vc else "")
    return Trace(name, fmt, jobs, skipped)


def _shift(job: TraceJob, t0: float) -> TraceJob:
    return dataclasses.replace(job, submit_time=job.submit_time - t0)


class _Row:
    """One CSV row with typed getters whose errors name the file, row and column."""

    def __init__(self, path: Path, line: int, row: dict[str, str]) -> None:
        self.path, self.line, self.row = path, line, row

    def error(self, msg: str) -> ConfigError:
        return ConfigError(f"{self.path} row {self.line}: {msg}")

    def text(self, col: str) -> str:
        v = (self.row.get(col) or "").strip()
        if not v:
            raise self.error(f"{col} is empty")
        return v

    def num(self, col: str, minimum: float | None = 0.0) -> float:
        v = self.text(col)
        try:
            x = float(v)
        except ValueError:
            raise self.error(f"{col} {v!r} is not a number") from None
        if math.isnan(x) or math.isinf(x) or (minimum is not None and x < minimum):
            raise self.error(f"{col} {v} must be a number >= {minimum:g}")
        return x

    def gpus(self, col: str) -> int:
        x = self.num(col)
        if x != int(x) or x < 1:
            raise self.error(f"{col} {self.row[col]} must be a whole number of GPUs >= 1")
        return int(x)

    def optional(self, col: str) -> str | None:
        v = (self.row.get(col) or "").strip()
        return v or None

    def count(self, col: str) -> int:
        """A whole number >= 0 in an optional column (0 if absent or empty)."""
        if self.optional(col) is None:
            return 0
        x = self.num(col)
        if x != int(x):
            raise self.error(f"{col} {self.row[col]} must be a whole number >= 0")
        return int(x)


def _gpucloud(r: _Row, skipped: Counter) -> TraceJob:
    est = r.optional("estimate")
    gpu_type = r.optional("gpu_type")
    return TraceJob(
        r.text("id"),
        r.num("submit_time", None),
        r.num("duration"),
        r.gpus("num_gpus"),
        int(r.num("gpu_milli")) if r.optional("gpu_milli") else 1000,
        r.optional("tenant") or "default",
        r.num("estimate") if est else None,
        int(r.num("priority", None)) if r.optional("priority") else 0,
        tuple(gpu_type.split("|")) if gpu_type else (),
        (r.optional("preemptible") or "true").lower() in ("1", "true", "yes"),
        r.count("cpu_milli"),
        r.count("memory_mib"),
    )


def _itp(r: _Row, skipped: Counter) -> TraceJob:
    return TraceJob(
        r.text("job_id"), r.num("submission_time", None), r.num("duration"), r.gpus("num_gpu")
    )


def _philly(r: _Row, skipped: Counter) -> TraceJob:
    ts = r.text("timestamp")
    try:
        submit = datetime.fromisoformat(ts).replace(tzinfo=UTC).timestamp()
    except ValueError:
        raise r.error(f"timestamp {ts!r} is not a date and time") from None
    return TraceJob(
        f"philly-{r.line}", submit, r.num("duration"), r.gpus("num_gpus"), tenant=r.text("cluster")
    )


def _tiresias(r: _Row, skipped: Counter) -> TraceJob:
    return TraceJob(r.text("job_id"), r.num("submit_time"), r.num("duration"), r.gpus("num_gpu"))


def _alibaba(r: _Row, skipped: Counter) -> TraceJob | None:
    """A pod runs from scheduled_time to deletion_time in the original cluster; pods that
    were never scheduled or ask for no GPU cannot be replayed and are counted as skipped."""
    if r.num("num_gpu") == 0:
        skipped["no GPU requested"] += 1
        return None
    if r.optional("scheduled_time") is None:
        skipped["never scheduled in the original cluster"] += 1
        return None
    start, end = r.num("scheduled_time"), r.num("deletion_time")
    if end < start:
        raise r.error(f"deletion_time {end:g} is before scheduled_time {start:g}")
    n = r.gpus("num_gpu")
    milli = int(r.num("gpu_milli"))
    if not 0 < milli <= 1000:
        raise r.error(f"gpu_milli {milli} must be in 1..1000")
    return TraceJob(
        r.text("name"),
        r.num("creation_time"),
        end - start,
        n,
        milli if n == 1 else 1000,
        tenant=r.optional("qos") or "default",
        cpu_milli=r.count("cpu_milli"),
        memory_mib=r.count("memory_mib"),
    )


_PARSERS: dict[str, Callable[[_Row, Counter], TraceJob | None]] = {
    "gpucloud": _gpucloud,
    "itp": _itp,
    "philly": _philly,
    "tiresias": _tiresias,
    "alibaba": _alibaba,
}


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write `trace` in the gpucloud CSV format (what `load_trace` reads back)."""
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["id", "submit_time", "duration", "num_gpus", "gpu_milli", "tenant", "estimate"]
            + ["priority", "gpu_type", "preemptible", "cpu_milli", "memory_mib"]
        )
        for j in trace.jobs:
            est = "" if j.estimate is None else f"{j.estimate:.3f}"
            w.writerow(
                [j.id, f"{j.submit_time:.3f}", f"{j.duration:.3f}", j.num_gpus, j.gpu_milli]
                + [j.tenant, est, j.priority, "|".join(j.gpu_types), str(j.preemptible).lower()]
                + [j.cpu_milli, j.memory_mib]
            )
