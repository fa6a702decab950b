"""Ground truth for the planner's per-GPU memory under DDP, FSDP2 and pipelines: the peak of
live tensor bytes of each rank of a real distributed run on this machine (CPU, gloo).

Each rank is its own process (spawned here, one thread each) that joins a gloo group, builds
the runtime's own `Trainer` for the config and runs a few optimizer steps, all under the
torch profiler with memory profiling on. The CPU allocator keeps no high-water mark and the
ranks' RSS includes the interpreter and torch itself, so the peak is read from the
allocation events instead: profiling starts before the model exists, hence the running sum
of allocations and frees is exactly the bytes this rank's tensors hold, and its maximum over
the steady-state steps (from the second one: optimizer states exist, DDP's buckets are
rebuilt) is the rank's peak. Collective libraries' own buffers (gloo, NCCL) are outside
torch's allocator here as on a GPU. The profiler misses the frees gloo's worker threads
make (`memory_probe.allocation_sizes`); one more step after the measured ones, which uses
every block still alive, shows which blocks those were.

The data is random tokens in the prepared-dataset format, so no tokenizer is needed.
"""

from __future__ import annotations

import gc
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

from gpucloud.train import config
from gpucloud.train.data import FORMAT_VERSION, META, token_dtype
from gpucloud.train.memory_probe import allocation_sizes, mark, marker_phase

STEPS = 2  # the peak is read over steps 2..STEPS; one more step after them witnesses


def write_random_dataset(out: Path, vocab_size: int, tokens: int, seed: int = 0) -> Path:
    """A `train` split of `tokens` uniformly random token ids, as `gpucloud data prepare`
    lays it out (one document)."""
    out.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    ids = np.random.Generator(np.random.PCG64(seed)).integers(0, vocab_size, tokens)
    ids.astype(dtype).tofile(out / "train.bin")
    np.zeros(1, dtype=np.uint64).tofile(out / "train.idx")
    meta = {"format": FORMAT_VERSION, "dtype": dtype.name, "vocab_size": vocab_size,
            "tokenizer": None, "splits": {"train": {"tokens": tokens, "documents": 1}}}  # fmt: skip
    (out / META).write_text(json.dumps(meta) + "\n")
    return out


def measure_rank_peaks(configs: list[dict], world_size: int) -> list[list[int]]:
    """For each run config (a dict, as a TOML file holds it), the peak bytes of live tensors
    of each of `world_size` ranks during steps 2..3: `peaks[config][rank]`.

    The configs run one after the other in the same `world_size` processes (one group).
    """
    with tempfile.TemporaryDirectory(prefix="rank-memory-") as tmp:
        root = Path(tmp)
        (root / "configs.json").write_text(json.dumps(configs))
        mp.start_processes(_rank_main, args=(world_size, root), nprocs=world_size,
                           start_method="spawn")  # fmt: skip
        ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(world_size)]
    return [[ranks[r][c] for r in range(world_size)] for c in range(len(configs))]


def _rank_main(rank: int, world_size: int, root: Path) -> None:
    from gpucloud.train.trainer import DistEnv, Trainer

    torch.set_num_threads(1)  # as torchrun gives each worker
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=rank,
                            world_size=world_size)  # fmt: skip
    env = DistEnv(rank, world_size, rank, torch.device("cpu"), "cpu", attempt=0)
    peaks = []
    try:
        for i, data in enumerate(json.loads((root / "configs.json").read_text())):
            cfg = config.parse(data)
            run_dir = root / f"run{i}"
            run_dir.mkdir(exist_ok=True)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                         record_shapes=True) as prof:  # fmt: skip
                trainer = Trainer(cfg, run_dir, env)
                trainer.train_step()
                mark(1)
                for _ in range(STEPS - 1):
                    trainer.train_step()
                mark(2)
                trainer.train_step()  # the witness: it uses every block still alive
            peaks.append(_peak_between_marks(allocation_sizes(prof, witnessed=True)))
            # Free the last run before the next profile starts: a free of a block allocated
            # before profiling would otherwise count against the next run's total.
            del trainer, prof
            gc.collect()
            dist.barrier()
    finally:
        dist.destroy_process_group()
    (root / f"rank{rank}.json").write_text(json.dumps(peaks))


def _peak_between_marks(sizes: list[int]) -> int:
    """The largest running total of allocations between the first marker and the second."""
    running, peak, phase = 0, 0, 0
    for size in sizes:
        if marker_phase(size) is not None:
            phase = max(phase, marker_phase(size))
            continue
        running += size
        if phase == 1:
            peak = max(peak, running)
    return peak
