"""Packing benchmark: FGD-style inflation of the Alibaba 2023 GPU-sharing trace.

Pods of `openb_pod_list_default.csv` (the ones that ask for a GPU and were scheduled in
the original cluster) are drawn with replacement and placed on the trace's own node list
(1,213 nodes, 6,212 GPUs) until the arrived workload reaches 100% of the cluster's GPUs
(`gpucloud.scheduler.sim.inflate`). The baseline is best-fit packing (`pack`) measured in
the same run; `fgd` is Fragmentation Gradient Descent (Weng et al., ATC'23) against the
trace's pod class mix; `spread` is shown for scale. Figures are averaged over seeds.

Printed: fragmentation rate (fragmented % of idle GPUs) at 90% and 100% arrived, the
share of requested GPUs that could not be allocated at 100%, GPUs allocated at the end,
and the ratios fgd / pack. Also the placement time per pod (fgd scores every node).
Pods hold their CPU and memory requests on the nodes' CPU and memory, as in the FGD
paper's simulator, so a node out of CPU strands its idle GPUs; GPU models are not
modelled (the default pod list names none).

Run: .venv/bin/python benchmarks/packing.py [--quick]
"""

from __future__ import annotations

import sys
import time

import numpy as np

from gpucloud.scheduler import load_trace, parse_cluster
from gpucloud.scheduler.sim.inflate import Inflation, inflate

TRACES = "/work/shared/traces/alibaba_openb_2023"
STRATEGIES = ("pack", "fgd", "spread")


def _figures(r: Inflation) -> dict[str, float]:
    end = r.curve[-1]
    return {
        "frag 90%": 100 * r.at(0.9).fragmentation_rate,
        "frag 100%": 100 * end.fragmentation_rate,
        "failed 100%": 100 * end.failure_share,
        "GPUs allocated": end.allocated_gpus,
        "fragmented GPUs": end.fragmented_gpus,
    }


def main() -> None:
    quick = "--quick" in sys.argv
    seeds = (0,) if quick else (0, 1, 2)
    trace = load_trace(f"{TRACES}/openb_pod_list_default.csv")
    nodes = parse_cluster(f"{TRACES}/openb_node_list_gpu_node.csv")
    print(f"{trace.name}: {len(trace.jobs)} GPU pods to draw from; {len(nodes)} nodes, "
          f"{sum(n.num_gpus for n in nodes)} GPUs; seeds {list(seeds)}")  # fmt: skip
    figures: dict[str, list[dict[str, float]]] = {s: [] for s in STRATEGIES}
    per_pod: dict[str, float] = {s: 0.0 for s in STRATEGIES}
    for seed in seeds:
        for s in STRATEGIES:
            t0 = time.process_time()
            r = inflate(trace, nodes, s, seed)
            per_pod[s] += (time.process_time() - t0) / r.pods / len(seeds)
            figures[s].append(_figures(r))
    mean = {
        s: {k: float(np.mean([f[k] for f in figures[s]])) for k in figures[s][0]}
        for s in STRATEGIES
    }
    keys = list(mean["pack"])
    print(f"\n{'placement':<10}" + "".join(f"{k:>17}" for k in keys) + f"{'ms / pod':>10}")
    for s in STRATEGIES:
        cells = "".join(f"{mean[s][k]:>17.2f}" for k in keys)
        print(f"{s:<10}{cells}{per_pod[s] * 1000:>10.3f}")
    print("\nfgd / pack (baseline measured in the same run):")
    for k in ("frag 100%", "GPUs allocated", "failed 100%"):
        base = mean["pack"][k]
        ratio = mean["fgd"][k] / base if base else float("nan")
        print(f"  {k:<15} {ratio:.4f}  ({mean['fgd'][k]:.2f} vs {base:.2f})")
    print(f"  placement time  {per_pod['fgd'] / per_pod['pack']:.1f}x pack's per pod")


if __name__ == "__main__":
    main()
