"""Tensor-parallel serving: one engine and `tensor_parallel_size` model ranks.

As in vLLM, the engine's own process is the driver and rank 0: it keeps the scheduler, the
block manager and the sampler, and holds the first shard of the model. It starts one worker
process per other rank (`tp_worker`); each loads its shard (gpucloud.models.tensor_parallel:
heads, MLP columns, vocabulary rows) and allocates the KV blocks of its own KV heads only,
block ids shared with every rank. Every step the driver's runner sends the step's inputs
(token ids, positions, slots, block tables) to the workers before its own forward pass;
the layers' all-reduces keep the ranks in step, and only the driver samples.

Until the runner starts, the driver's collectives do nothing: the engine's memory profile
is a forward pass of the driver's shard alone, whose values nobody reads.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import asdict, replace
from pathlib import Path

import torch

from gpucloud.errors import GpucloudError
from gpucloud.models.llama import LlamaForCausalLM
from gpucloud.models.spec import ModelSpec
from gpucloud.models.tensor_parallel import Shard, check_tensor_parallel
from gpucloud.serve.config import EngineConfig
from gpucloud.serve.lora import LoraManager
from gpucloud.serve.runner import ModelRunner
from gpucloud.serve.tp_group import TensorParallelGroup, file_store, rank_device
from gpucloud.serve.tp_layers import load_rank, parameter_bytes, wire
from gpucloud.serve.tp_worker import FORWARD, LORA, MEMORY, START

_POLL = 0.05  # seconds between looks at the workers while they load
_LOAD_TIMEOUT = 900.0


class WorkerError(GpucloudError):
    """A tensor-parallel worker died or did not load."""


class TensorParallelWorkers:
    """The worker processes of one engine. `stop` (or garbage collection, or the driver's
    exit) ends them: closing their stdin is their signal."""

    def __init__(self, procs: list[subprocess.Popen], store_dir: Path, spec: ModelSpec):
        self.procs, self.spec = procs, spec  # the whole model's spec
        self.group: TensorParallelGroup | None = None
        self._finalizer = weakref.finalize(self, _end, procs, store_dir)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def runner(self, model: LlamaForCausalLM, config: EngineConfig, num_blocks: int,
               lora: LoraManager | None = None):  # fmt: skip
        return DriverRunner(model, config, num_blocks, self.group, lora)

    def lora(self, model: LlamaForCausalLM, config: EngineConfig) -> LoraManager:
        """The engine's adapters on rank 0's shard: checked against the whole model, each
        rank holding its part."""
        return LoraManager(model, config.max_loras, config.max_lora_rank, self.spec,
                           Shard(0, self.group.size))  # fmt: skip

    def stop(self) -> None:
        self._finalizer()


class DriverRunner(ModelRunner):
    """The engine's runner on rank 0: each forward pass is announced to the workers."""

    def __init__(self, model, config: EngineConfig, num_blocks: int, group: TensorParallelGroup,
                 lora: LoraManager | None = None):  # fmt: skip
        super().__init__(model, config, num_blocks, lora)
        self.group = group
        group.send((START, num_blocks))
        group.active = True
        if lora is not None:  # a slot loaded here is loaded on every rank, before its forward
            lora.on_load = lambda slot, weights: group.send((LORA, slot, weights))

    def _forward(self, inputs):
        # The sequences stay here: workers need only the tensors, the prefill layout and
        # which rows take which adapter slot.
        groups = self.lora.batch.groups if self.lora is not None else []
        stripped = replace(inputs, sample_seqs=[], drafted=[], scored=[], row_adapters=[])
        self.group.send((FORWARD, stripped, groups))
        return super()._forward(inputs)

    def rank_memory(self) -> list[tuple[int, int]]:
        """Per rank, the bytes of its weights and of its KV cache, as allocated."""
        self.group.send((MEMORY,))
        ranks = self.group.gather_ints([parameter_bytes(self.model), self.cache.nbytes])
        return [(weights, cache) for weights, cache in ranks]


def start(
    model_dir: str | Path, config: EngineConfig
) -> tuple[LlamaForCausalLM, TensorParallelWorkers]:
    """Rank 0's shard of `model_dir` and the running workers of the other ranks. Raises
    ConfigError (before any process starts) when the model does not split into
    `config.tensor_parallel_size` ranks, WorkerError when a worker dies while loading."""
    size, spec = config.tensor_parallel_size, ModelSpec.from_dir(model_dir)
    check_tensor_parallel(spec, size)
    store_dir = Path(tempfile.mkdtemp(prefix="gpucloud-tp-"))
    threads = _threads_per_rank(config, size)
    procs = [_spawn(model_dir, config, r, size, store_dir, spec.vocab_size, threads)
             for r in range(1, size)]  # fmt: skip
    workers = TensorParallelWorkers(procs, store_dir, spec)
    try:
        device = rank_device(config, 0)
        model = load_rank(model_dir, config, 0, size, device)
        store = file_store(store_dir, size)
        _wait_loaded(store, procs)
        workers.group = TensorParallelGroup(store, 0, size, device)
        wire(model, workers.group, spec.vocab_size)
    except BaseException:
        workers.stop()
        raise
    return model, workers


def rank_config(config: EngineConfig) -> EngineConfig:
    """The config each rank sizes its KV cache with: on the CPU the ranks share the host's
    free memory, so each takes its share of the fraction."""
    if rank_device(config, 0).type != "cpu":
        return config
    fraction = config.kv_cache_memory_fraction / config.tensor_parallel_size
    return replace(config, kv_cache_memory_fraction=fraction)


def _threads_per_rank(config: EngineConfig, size: int) -> int:
    """On the CPU the ranks share the cores: each gets its part (the driver too)."""
    if rank_device(config, 0).type != "cpu":
        return 0
    threads = max(1, torch.get_num_threads() // size)
    torch.set_num_threads(threads)
    return threads


def _spawn(model_dir, config, rank, size, store_dir, vocab_size, threads) -> subprocess.Popen:
    argv = [sys.executable, "-m", "gpucloud.serve.tp_worker", "--model-dir", str(model_dir),
            "--rank", str(rank), "--size", str(size), "--store-dir", str(store_dir),
            "--vocab-size", str(vocab_size), "--threads", str(threads),
            "--config", json.dumps(asdict(config))]  # fmt: skip
    return subprocess.Popen(argv, stdin=subprocess.PIPE)


def _wait_loaded(store, procs: list[subprocess.Popen]) -> None:
    keys = [f"loaded/{r}" for r in range(1, len(procs) + 1)]
    deadline = time.monotonic() + _LOAD_TIMEOUT
    while not store.check(keys):
        for rank, p in enumerate(procs, start=1):
            if p.poll() is not None:
                raise WorkerError(f"tensor-parallel worker {rank} exited with code "
                                  f"{p.returncode} while loading (its error is above)")  # fmt: skip
        if time.monotonic() > deadline:
            raise WorkerError(f"tensor-parallel workers did not load in {_LOAD_TIMEOUT:.0f} s")
        time.sleep(_POLL)


def _end(procs: list[subprocess.Popen], store_dir: Path) -> None:
    for p in procs:
        if p.stdin is not None:
            p.stdin.close()  # the worker's cue to exit
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    shutil.rmtree(store_dir, ignore_errors=True)
