"""What GPU time costs: price versions per GPU type and pool, applied piecewise.

A price version holds from its effective date until the next version of the same GPU
type and pool. At any moment a node's GPUs cost its pool's price (a pool is the nodes with
one label, "key=value"), else the price of every node of the type (pool ""), else the
hardware catalog's price. An interval that spans a change is priced in pieces, so usage
before a change keeps the price it had.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from gpucloud import hardware

ALL_NODES = ""  # the pool of every node of a GPU type


@dataclass
class PriceBook:
    # (gpu_type, pool) -> [(effective_from, USD per GPU-hour)], by effective_from
    versions: dict[tuple[str, str], list[tuple[float, float]]] = field(default_factory=dict)
    node_labels: dict[str, dict[str, str]] = field(default_factory=dict)  # node -> labels

    def add(self, gpu_type: str, pool: str, effective_from: float, per_hour: float) -> None:
        series = self.versions.setdefault((gpu_type, pool), [])
        bisect.insort(series, (effective_from, per_hour))

    def pool_of(self, gpu_type: str, node: str | None) -> str:
        """The priced pool `node` belongs to for `gpu_type`: the first (by name) of its
        labels with a price of that type, else ALL_NODES."""
        labels = self.node_labels.get(node or "", {})
        pools = sorted(f"{k}={v}" for k, v in labels.items())
        return next((p for p in pools if (gpu_type, p) in self.versions), ALL_NODES)

    def per_hour(self, gpu_type: str, node: str | None, at: float) -> float:
        """USD per GPU-hour of `gpu_type` on `node` at time `at`."""
        pool = self.pool_of(gpu_type, node)
        for key in ((gpu_type, pool), (gpu_type, ALL_NODES)):
            series = self.versions.get(key, [])
            i = bisect.bisect_right(series, (at, float("inf")))
            if i:
                return series[i - 1][1]
        return hardware.get(gpu_type).price_per_hour

    def cost(self, gpu_type: str, node: str | None, gpus: float, start: float, end: float) -> float:
        """USD for `gpus` GPUs held from `start` to `end`, each piece at its own price."""
        cuts = [start, *self._changes(gpu_type, node, start, end), end]
        return sum(
            (b - a) * gpus / 3600 * self.per_hour(gpu_type, node, a)
            for a, b in zip(cuts, cuts[1:], strict=False)
            if b > a
        )

    def _changes(self, gpu_type: str, node: str | None, start: float, end: float) -> list[float]:
        pool = self.pool_of(gpu_type, node)
        dates: Iterable[float] = (
            at
            for key in {(gpu_type, pool), (gpu_type, ALL_NODES)}
            for at, _ in self.versions.get(key, [])
        )
        return sorted({at for at in dates if start < at < end})
