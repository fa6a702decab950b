"""Prometheus metrics of one server: latencies observed per request, engine state read at
scrape time (so gauges and counters are never stale and cost nothing between scrapes)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpucloud.serve.api.bridge import RequestTiming
from gpucloud.serve.api.startup import Startup
from gpucloud.serve.engine import LLMEngine

PREFIX = "gpucloud_serve"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)


class ServerMetrics:
    def __init__(self, engine: LLMEngine, model_name: str, startup: Startup):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Arrival to first output token.",
            labels, registry=self.registry, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds", "Mean gap between output tokens.",
            labels, registry=self.registry, buckets=_TPOT_BUCKETS,
        )  # fmt: skip
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds", "Arrival to last output token.",
            labels, registry=self.registry, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.finished = Counter(
            f"{PREFIX}_request_success", "Finished completions by finish reason.",
            [*labels, "finished_reason"], registry=self.registry,
        )  # fmt: skip
        self.rejected = Counter(
            f"{PREFIX}_requests_rejected", "Requests refused before reaching the engine.",
            [*labels, "reason"], registry=self.registry,
        )  # fmt: skip
        self.model_name = model_name
        self.registry.register(_EngineCollector(engine, model_name))
        self.registry.register(_StartupCollector(startup, model_name))

    def observe(self, t: RequestTiming) -> None:
        name = self.model_name
        self.e2e.labels(name).observe(t.finished - t.arrival)
        if t.first_token is not None:
            self.ttft.labels(name).observe(t.first_token - t.arrival)
            if t.num_output_tokens > 1:
                gap = (t.finished - t.first_token) / (t.num_output_tokens - 1)
                self.tpot.labels(name).observe(gap)
        for reason in t.finish_reasons:
            self.finished.labels(name, reason).inc()

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(self, engine: LLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        gauges = {
            "num_requests_running": ("Sequences holding KV blocks.", s.num_running),
            "num_requests_waiting": ("Sequences queued or preempted.", s.num_waiting),
            "kv_cache_usage_perc": ("Fraction of KV blocks in use (0-1).", s.kv_usage),
            "kv_cache_blocks": ("KV blocks in the pool.", s.num_blocks),
            "prefix_cache_hit_rate": ("Prompt tokens served from the prefix cache (0-1).",
                                      s.prefix_cache_hit_rate),
            "spec_decode_draft_acceptance_rate": ("Speculative tokens accepted / proposed (0-1).",
                                                  s.acceptance_rate),
        }  # fmt: skip
        counters = {
            "prompt_tokens": ("Prompt tokens computed.", s.prompt_tokens),
            "generation_tokens": ("Output tokens generated.", s.generation_tokens),
            "num_preemptions": ("Sequences preempted for lack of KV blocks.", s.num_preemptions),
            "engine_steps": ("Engine steps run.", s.num_steps),
            "spec_decode_num_draft_tokens": ("Speculative tokens proposed and verified.",
                                             s.draft_tokens),
            "spec_decode_num_accepted_tokens": ("Speculative tokens greedy decoding confirmed.",
                                                s.accepted_tokens),
        }  # fmt: skip
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            yield g
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c


class _StartupCollector(Collector):
    """The start phases (startup.py) as Unix timestamps; a phase not reached yet is left out."""

    def __init__(self, startup: Startup, model_name: str):
        self.startup = startup
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            f"{PREFIX}_startup_timestamp_seconds",
            "When the process started, its weights were loaded and it became ready (Unix time).",
            labels=["model_name", "phase"],
        )
        for phase, at in self.startup.phases().items():
            if at is not None:
                g.add_metric([self.model_name, phase], at)
        yield g
