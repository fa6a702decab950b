"""`gpucloud plan train`'s peak per GPU against each rank's measured peak when the runtime's
own Trainer runs the same layout on 2 CPU ranks (gloo): within 10% for DDP and FSDP2.

On this machine both land within 6% (benchmarks/planner_vs_runtime.py prints every layout,
pipelines too); 10% is the issue's bar for a planner used to size real GPUs.
"""

import pytest

from gpucloud.models.presets import PRESETS
from gpucloud.planner.memory import estimate_training_memory
from gpucloud.train import config
from gpucloud.train.rank_memory import measure_rank_peaks, planner_setup, write_random_dataset

pytestmark = pytest.mark.timeout(300)
WORLD = 2
LAYOUTS = {"ddp": (), "fsdp": ("parallel.strategy='fsdp'",)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[config.RunConfig, list[int]]]:
    data = write_random_dataset(tmp_path_factory.mktemp("tokens"), 2048, 20_000)
    cfgs = {}
    for name, overrides in LAYOUTS.items():
        cfg = {"model": {"preset": "tiny"}, "data": {"path": str(data), "seq_len": 256},
               "optim": {"global_batch": 4, "micro_batch": 2, "max_steps": 100}}  # fmt: skip
        for item in overrides:
            config.apply_override(cfg, item)
        cfgs[name] = cfg
    peaks = measure_rank_peaks(list(cfgs.values()), WORLD)
    return {n: (config.parse(c), p) for (n, c), p in zip(cfgs.items(), peaks, strict=True)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_planned_peak_is_within_10_percent_of_every_rank_s_measured_peak(runs, layout):
    cfg, peaks = runs[layout]
    setup = planner_setup(cfg, WORLD)
    assert setup.zero == {"ddp": 0, "fsdp": 3}[layout]
    planned = estimate_training_memory(PRESETS["tiny"], setup).stage.peak_bytes
    for peak in peaks:
        assert planned == pytest.approx(peak, rel=0.10)
