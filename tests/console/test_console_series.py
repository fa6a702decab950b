"""The console's series: histogram percentiles, a deployment's traffic points, and the
month's usage cut by day (pure functions and fabricated inputs, no server)."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gpucloud.control.accounting import Interval
from gpucloud.control.console import serving, usage_series
from gpucloud.control.metrics import Metrics
from gpucloud.control.price_book import PriceBook

INF = math.inf


def test_quantiles_interpolate_within_buckets_as_prometheus_does():
    buckets = {0.1: 50.0, 0.2: 90.0, 0.4: 100.0, INF: 100.0}
    assert serving.quantile(0.5, buckets) == pytest.approx(0.1)
    assert serving.quantile(0.7, buckets) == pytest.approx(0.15)
    assert serving.quantile(0.99, buckets) == pytest.approx(0.38)
    assert serving.quantile(0.5, {0.1: 0.0, INF: 0.0}) is None
    assert serving.quantile(0.99, {0.1: 1.0, INF: 10.0}) == 0.1  # past the last bound


def _engine_metrics(ttfts: list[float]) -> str:
    """A replica's /metrics text with the engine's histogram names and these TTFTs."""
    registry = CollectorRegistry()
    ttft = Histogram(serving.HISTOGRAMS["ttft"], "", ["model_name"], registry=registry,
                     buckets=(0.05, 0.1, 0.5, 1))  # fmt: skip
    for t in ttfts:
        ttft.labels("m").observe(t)
    return generate_latest(registry).decode()


def test_a_point_holds_the_traffic_since_the_previous_sample():
    metrics = Metrics(store=None)  # the store is read only when Prometheus scrapes
    sampler = serving.Sampler(metrics, wall=lambda: 1e9)
    dep = serving.Deployment(7, "a", "web", {1: "http://replica-1", 2: "http://replica-2"})
    metrics.gateway_requests.labels("a", "web", "200").inc(10)

    def sample(at: float, **replicas: list[float]) -> dict:
        counts = serving.gateway_counts(metrics)[("a", "web")]
        scraped = {int(r[1:]): serving.histograms(_engine_metrics(t)) for r, t in replicas.items()}
        sampler.record(dep, counts, scraped, at)
        return sampler.public(7)

    assert sample(100.0, r1=[0.02] * 10)["at"] == []  # the first sample is the baseline
    metrics.gateway_requests.labels("a", "web", "200").inc(18)
    metrics.gateway_requests.labels("a", "web", "500").inc(2)
    metrics.gateway_requests.labels("b", "web", "200").inc(99)  # another tenant's "web"
    s = sample(110.0, r1=[0.02] * 10 + [0.3] * 20)
    assert s["at"] == [1e9]
    assert s["requests_per_s"] == [2.0] and s["errors_per_s"] == [0.2]
    assert 0.1 < s["ttft_p50"][0] <= 0.5  # only the 20 new observations count
    assert s["tpot_p50"] == [None]  # no stream: no time per output token
    # replica 1 restarted (its counts fell), replica 2 is new: all of each counts
    s = sample(120.0, r1=[0.02] * 4, r2=[0.02] * 4)
    assert s["requests_per_s"][-1] == 0.0 and s["ttft_p99"][-1] <= 0.05
    assert sampler.due(dep, 120.5) is False and sampler.due(dep, 121.0) is True


def test_malformed_engine_metrics_are_an_error():
    with pytest.raises(ValueError):
        serving.histograms("gpucloud_serve_time_to_first_token_seconds_bucket{le=oops} 1")


def test_usage_is_cut_at_day_boundaries_and_priced_per_piece():
    day = usage_series.DAY
    book = PriceBook()
    book.add("H100-SXM", "", 0.0, 2.0)  # USD per GPU-hour
    book.add("H100-SXM", "", 1.5 * day, 4.0)  # dearer from the middle of day 2

    def held(tenant: str, start: float, end: float, gpus: int = 2) -> Interval:
        return Interval(tenant_id=1, tenant=tenant, user="u", labels={}, kind="job", id=1,
                        name="j", gpu_type="H100-SXM", node="n", gpus=gpus, start=start,
                        end=end, open=False, requested_end=None)  # fmt: skip

    used = usage_series.by_day(
        [held("a", 0.5 * day, 2 * day), held("b", 2.5 * day, 9 * day, gpus=1)], book, 0.0, 3
    )
    hours, cost = used["a"]
    assert hours == pytest.approx([24.0, 48.0, 0.0])
    assert cost == pytest.approx([48.0, 24 * 2 + 24 * 4, 0.0])
    assert used["b"][0] == pytest.approx([0.0, 0.0, 12.0])  # clipped to the 3 days
    assert usage_series.running_total([1.0, 2.0, 3.0]) == [1.0, 3.0, 6.0]


def test_a_deployments_split_over_time_steps_at_each_change_until_now():
    from gpucloud.control.console.views import traffic_split
    from gpucloud.control.schemas import DeploymentHistory, TrafficEvent

    def event(at, action, traffic):
        return TrafficEvent(at=at, action=action, user="u", traffic=traffic, reason=None)

    history = DeploymentHistory(name="chat", versions=[], events=[
        event(10.0, "create", {"1": 100.0}),
        event(20.0, "rollout", {"1": 50.0, "2": 50.0}),
        event(30.0, "promote", {"2": 100.0}),
        event(40.0, "rollout", {"2": 90.0, "10": 10.0}),
    ])  # fmt: skip
    split = traffic_split(history, now=50.0)
    assert split["at"] == [10.0, 20.0, 30.0, 40.0, 50.0]
    assert split["versions"] == [
        {"version": 1, "percent": [100.0, 50.0, None, None, None]},
        {"version": 2, "percent": [None, 50.0, 100.0, 90.0, 90.0]},
        {"version": 10, "percent": [None, None, None, 10.0, 10.0]},  # ordered by number
    ]
