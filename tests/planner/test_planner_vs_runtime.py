"""`gpucloud plan train`'s peak per GPU against each rank's measured peak when the runtime's
own Trainer runs the same layout on 2 CPU ranks (gloo): within 10% for DDP, FSDP2 and tensor
parallel (TP2, logits gathered whole for the loss).

On this machine they land within 6% (benchmarks/planner_vs_runtime.py prints every layout,
pipelines too); 10% is the issue's bar for a planner used to size real GPUs.
"""

import pytest

from gpucloud.models.presets import PRESETS
from gpucloud.planner.memory import estimate_training_memory
from gpucloud.train import config
from gpucloud.train.plan import planner_setup
from gpucloud.train.rank_memory import measure_rank_peaks, write_random_dataset

pytestmark = pytest.mark.timeout(300)
WORLD = 2
LAYOUTS = {
    "ddp": (),
    "fsdp": ("parallel.strategy='fsdp'",),
    "tp": ("parallel.tp=2", "optim.global_batch=2"),  # both ranks split one model
}


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
    assert (setup.zero, setup.tp) == {"ddp": (0, 1), "fsdp": (3, 1), "tp": (0, 2)}[layout]
    planned = estimate_training_memory(PRESETS["tiny"], setup).stage.peak_bytes
    # Every rank, the highest too: under TP the ranks' peaks used to differ by the LM
    # head's local logits and their gathered copy (6.3 MB), freed on gloo's worker thread,
    # which the profiler does not see (memory_probe.allocation_sizes).
    for peak in peaks:
        assert planned == pytest.approx(peak, rel=0.10)


def test_a_free_the_profiler_misses_counts_where_the_block_was_last_read():
    """The profiler records frees on its own thread only; gloo's worker threads drop a
    finished collective's tensors. A block freed on another thread, never reused and not
    read by the witness step after the last marker, is freed where its last reader ended."""
    import threading

    import torch
    from torch.profiler import ProfilerActivity, profile

    from gpucloud.train.memory_probe import allocation_sizes, mark

    def sizes() -> tuple[list[int], list[int]]:
        """The two big blocks' sizes as the probe counts them, and as the profiler saw them."""
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                     record_shapes=True) as prof:  # fmt: skip
            mark(1)
            held = [torch.ones(3_000_000, dtype=torch.uint8)]
            held[0].sum()  # its last reader
            worker = threading.Thread(target=held.clear)
            worker.start()
            worker.join()
            torch.zeros(5_000_000, dtype=torch.uint8)  # the peak, after the block is gone
            mark(2)
            torch.zeros(1000).sum()  # the witness step
        big = (3_000_000, 5_000_000)
        return (
            [s for s in allocation_sizes(prof, witnessed=True) if abs(s) in big],
            [s for s in allocation_sizes(prof) if abs(s) in big],
        )

    # The profiler usually misses the other thread's free, but not always (it recorded it
    # once in a full suite run): try until it misses it, counting right every time.
    for _ in range(5):
        counted, recorded = sizes()
        assert counted == [3_000_000, -3_000_000, 5_000_000, -5_000_000]
        if recorded == [3_000_000, 5_000_000, -5_000_000]:  # the free it missed
            break
    else:
        pytest.fail(f"the profiler recorded the other thread's free in 5 runs: {recorded}")
