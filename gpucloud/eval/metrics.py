"""Metrics of a task from its per-item records, with bootstrap confidence intervals.

Every metric is a ratio of sums over items, then a transform: accuracy is Σ correct / n,
word perplexity is exp(-Σ loglikelihood / Σ words). Resampling items with replacement and
recomputing the ratio gives the interval of either kind the same way; resampling the same
items for two models (paired) gives the interval of their difference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from gpucloud.errors import NotFoundError
from gpucloud.eval.tasks import TaskKind

RESAMPLES = 1000
CONFIDENCE = 0.95


def _identity(x):
    return x


def _perplexity(x):
    return np.exp(-x)


def _bits(x):
    return -x / math.log(2)


@dataclass(frozen=True, slots=True)
class Metric:
    name: str
    kind: TaskKind
    numerator: str  # record key summed over items
    denominator: str | None  # record key summed over items; None: the number of items
    transform: Callable
    higher_is_better: bool

    def value(self, records: Sequence[dict], idx: np.ndarray | None = None) -> np.ndarray:
        """The metric over `records`, or over each row of item indices in `idx`."""
        num = np.array([r[self.numerator] for r in records], dtype=np.float64)
        den = (
            np.ones_like(num)
            if self.denominator is None
            else np.array([r[self.denominator] for r in records], dtype=np.float64)
        )
        if idx is not None:
            num, den = num[idx], den[idx]
        return self.transform(num.sum(axis=-1) / den.sum(axis=-1))


MC, PPL, GEN = TaskKind.MULTIPLE_CHOICE, TaskKind.PERPLEXITY, TaskKind.GENERATION
METRICS = {
    m.name: m
    for m in [
        Metric("acc", MC, "acc", None, _identity, True),
        Metric("acc_norm", MC, "acc_norm", None, _identity, True),
        Metric("word_perplexity", PPL, "loglikelihood", "words", _perplexity, False),
        Metric("byte_perplexity", PPL, "loglikelihood", "bytes", _perplexity, False),
        Metric("bits_per_byte", PPL, "loglikelihood", "bytes", _bits, False),
        Metric("exact_match", GEN, "exact_match", None, _identity, True),
    ]
}
PRIMARY = {MC: "acc", PPL: "word_perplexity", GEN: "exact_match"}


def metrics_of(kind: TaskKind) -> list[Metric]:
    return [m for m in METRICS.values() if m.kind is kind]


def metric_for(kind: TaskKind, name: str | None) -> Metric:
    """The metric `name` of a task of `kind` (its primary one for None). Raises
    NotFoundError naming the metrics a task of that kind has."""
    choices = [m.name for m in metrics_of(kind)]
    name = name or PRIMARY[kind]
    if name not in choices:
        raise NotFoundError(f"a {kind} task has no metric {name!r}: use {', '.join(choices)}")
    return METRICS[name]


def resample(n: int, seed: int, resamples: int = RESAMPLES) -> np.ndarray:
    """[resamples, n] item indices drawn with replacement, the same for the same seed."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def interval(samples: np.ndarray) -> tuple[float, float]:
    """The central CONFIDENCE interval of bootstrap samples (percentile method)."""
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail])
    return float(low), float(high)


def bootstrap_ci(metric: Metric, records: Sequence[dict], seed: int) -> tuple[float, float]:
    return interval(metric.value(records, resample(len(records), seed)))
