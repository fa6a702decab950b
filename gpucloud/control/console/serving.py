"""Each deployment's traffic over time: request rate and errors (the gateway's own counter)
and TTFT and TPOT percentiles (the histograms each replica's engine exports on /metrics,
gpucloud/serve/api/metrics.py).

A sample reads both and keeps the difference since the previous one as one point, so a
point covers the time between two samples: the deployments page samples while it is
open (at most every MIN_INTERVAL seconds, whoever asks), and a point after a pause covers
the whole pause. The first sample of a deployment is the baseline only. A replica new
since the previous sample counts from zero; one whose counts fell (restarted) too.
Memory is bounded: POINTS points per deployment, MAX_DEPLOYMENTS deployments (the one
sampled longest ago goes first). Percentiles are interpolated within histogram buckets,
as Prometheus' histogram_quantile does.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gpucloud.control.metrics import Metrics

MIN_INTERVAL = 1.0  # seconds between two samples of one deployment
POINTS = 720  # points kept per deployment: an hour at the page's 5 s polling
MAX_DEPLOYMENTS = 1000
SCRAPE_TIMEOUT = 2.0  # seconds a replica's /metrics may take; a late one is left out
MAX_METRICS_BYTES = 1024 * 1024  # a replica's /metrics is the tenant's process: bounded
QUANTILES = (0.5, 0.9, 0.99)
# The replicas' histograms (gpucloud_serve_* in gpucloud/serve/api/metrics.py).
HISTOGRAMS = {
    "ttft": "gpucloud_serve_time_to_first_token_seconds",
    "tpot": "gpucloud_serve_time_per_output_token_seconds",
}

Buckets = dict[float, float]  # upper bound (le) -> cumulative count


@dataclass(frozen=True, slots=True)
class Deployment:
    """A deployment to sample: its id, its tenant and name (the gateway counter's labels),
    and the URLs of its READY replicas by replica id."""

    id: int
    tenant: str
    name: str
    replicas: dict[int, str]


@dataclass(slots=True)
class Series:
    at: deque = field(default_factory=lambda: deque(maxlen=POINTS))  # epoch seconds
    values: dict[str, deque] = field(default_factory=dict)  # name -> a value per point
    counts: tuple[float, float] | None = None  # gateway requests, errors: cumulative
    histograms: dict[int, dict[str, Buckets]] = field(default_factory=dict)  # by replica
    sampled: float = -math.inf  # monotonic

    def add(self, at: float, point: dict[str, float | None]) -> None:
        self.at.append(at)
        for name, value in point.items():
            self.values.setdefault(name, deque(maxlen=POINTS)).append(value)

    def public(self) -> dict:
        return {"at": list(self.at), **{k: list(v) for k, v in self.values.items()}}


def quantile(q: float, buckets: Buckets) -> float | None:
    """The `q` quantile of observations counted in cumulative `buckets` (None if none),
    interpolated linearly within its bucket; past the last finite bound, that bound."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            width = count - below
            return le if width <= 0 else lower + (le - lower) * (rank - below) / width
        lower, below = le, count
    return lower


def histograms(text: str) -> dict[str, Buckets]:
    """The HISTOGRAMS' cumulative buckets in a /metrics text, summed over label sets.
    Raises ValueError if the text is not Prometheus' format."""
    wanted = {f"{family}_bucket": name for name, family in HISTOGRAMS.items()}
    out: dict[str, Buckets] = {name: {} for name in HISTOGRAMS}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = wanted.get(sample.name)
            le = sample.labels.get("le")
            if name is None or le is None or not math.isfinite(sample.value):
                continue
            bound = float(le)
            out[name][bound] = out[name].get(bound, 0.0) + max(sample.value, 0.0)
    return out


def _delta(now: Buckets, before: Buckets | None) -> Buckets:
    """Counts since `before`; all of `now` if there was none or a count fell (restart)."""
    if before is None or any(now.get(le, 0.0) < c for le, c in before.items()):
        return dict(now)
    return {le: c - before.get(le, 0.0) for le, c in now.items()}


def _sum(parts: list[Buckets]) -> Buckets:
    out: Buckets = {}
    for part in parts:
        for le, c in part.items():
            out[le] = out.get(le, 0.0) + c
    return out


def gateway_counts(metrics: Metrics) -> dict[tuple[str, str], tuple[float, float]]:
    """(tenant, deployment) -> requests the /v1 gateway relayed to it since the control
    plane started, and how many of them failed (a status of 400 or more): the gateway's
    own Prometheus counter, read in place."""
    out: dict[tuple[str, str], tuple[float, float]] = {}
    for family in metrics.gateway_requests.collect():
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            labels = sample.labels
            key = (labels["tenant"], labels["deployment"])
            requests, errors = out.get(key, (0.0, 0.0))
            failed = sample.value if int(labels["status"]) >= 400 else 0.0
            out[key] = (requests + sample.value, errors + failed)
    return out


class Sampler:
    """The deployments' series, sampled on demand (see the module doc)."""

    def __init__(
        self,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.metrics = metrics
        self.clock, self.wall = clock, wall
        self._series: OrderedDict[int, Series] = OrderedDict()

    async def series(self, http: httpx.AsyncClient, deps: list[Deployment]) -> dict[int, dict]:
        """Deployment id -> its series (times and values), each sampled first if due."""
        now = self.clock()
        due = [d for d in deps if self.due(d, now)]
        if due:
            counts = gateway_counts(self.metrics)
            scraped = await asyncio.gather(*(_scrape_all(http, d) for d in due))
            for d, replicas in zip(due, scraped, strict=True):
                self.record(d, counts.get((d.tenant, d.name), (0.0, 0.0)), replicas, now)
        return {d.id: self.public(d.id) for d in deps}

    def due(self, d: Deployment, now: float) -> bool:
        s = self._series.get(d.id)
        return s is None or now - s.sampled >= MIN_INTERVAL

    def public(self, dep_id: int) -> dict:
        """The series of deployment `dep_id`: its times and each value's list."""
        s = self._series.get(dep_id)
        return s.public() if s is not None else {"at": []}

    def record(
        self,
        d: Deployment,
        counts: tuple[float, float],
        replicas: dict[int, dict[str, Buckets]],
        now: float,
    ) -> None:
        """One sample of `d` at `now` (monotonic): the gateway's cumulative (requests,
        errors), and the histograms of the replicas that answered. Adds a point unless it
        is the deployment's first sample."""
        s = self._series.get(d.id)
        if s is None:
            s = self._series[d.id] = Series()
            while len(self._series) > MAX_DEPLOYMENTS:
                self._series.popitem(last=False)
        self._series.move_to_end(d.id)
        if s.counts is not None:
            seconds = max(now - s.sampled, 1e-9)
            requests = max(counts[0] - s.counts[0], 0.0)
            errors = max(counts[1] - s.counts[1], 0.0)
            point: dict[str, float | None] = {
                "requests_per_s": requests / seconds,
                "errors_per_s": errors / seconds,
            }
            for name in HISTOGRAMS:
                merged = _sum(
                    [
                        _delta(h[name], s.histograms.get(rid, {}).get(name))
                        for rid, h in replicas.items()
                    ]
                )
                for q in QUANTILES:
                    point[f"{name}_p{q * 100:g}"] = quantile(q, merged)
            s.add(self.wall(), point)
        # a replica that did not answer this time keeps its last counts as its baseline
        kept = {rid: h for rid, h in s.histograms.items() if rid in d.replicas}
        s.counts, s.histograms, s.sampled = counts, {**kept, **replicas}, now


async def _scrape_all(http: httpx.AsyncClient, d: Deployment) -> dict[int, dict[str, Buckets]]:
    got = await asyncio.gather(*(_scrape(http, url) for url in d.replicas.values()))
    return {rid: h for rid, h in zip(d.replicas, got, strict=True) if h is not None}


async def _scrape(http: httpx.AsyncClient, url: str) -> dict[str, Buckets] | None:
    """A replica's histograms, or None if it did not answer in time or in format."""
    try:
        async with http.stream("GET", url + "/metrics", timeout=SCRAPE_TIMEOUT) as response:
            if response.status_code != 200:
                return None
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_METRICS_BYTES:
                    return None
        return histograms(body.decode(errors="replace"))
    except (httpx.HTTPError, ValueError):
        return None
