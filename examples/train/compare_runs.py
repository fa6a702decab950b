"""Compare the losses of two `gpucloud train run` runs, step by step.

    python examples/train/compare_runs.py RUN_DIR OTHER_RUN_DIR

A step logged twice (replayed after a resume) counts with its last value. Exits 1 when the
runs logged different steps or any loss differs.
"""

import json
import sys
from pathlib import Path


def losses(run_dir: str) -> dict[int, float]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


a, b = (losses(d) for d in sys.argv[1:3])
same = a == b
last = max(a)
print(f"steps {min(a)}-{last}: identical losses: {same}; step {last} loss {a[last]}")
sys.exit(0 if same else 1)
