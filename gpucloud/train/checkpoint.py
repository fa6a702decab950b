"""Sharded checkpoints as `step-N` directories, committed by DCP's `.metadata`.

A directory holds `torch.distributed.checkpoint` shards of model and optimizer (each rank
writes its own part), `train.json` (step, loss scaler, health window; rank 0) and
`rng/rankR.pt`. Model and optimizer are keyed by parameter name (`state_dict_of`), so
with any strategy each rank writes and reads the entries of the parameters it holds.
The small files are written before the shards; DCP writes `.metadata` last, after every
rank has finished (atomically, via a rename), so a directory with `.metadata` is
complete and one without it is a crash leftover that resume ignores.

The root is a `storage.Location`: a local (or shared-filesystem) path, or a URL such as
`s3://bucket/run1/ckpt`, so a job moved to another machine resumes from the same steps. On
object storage DCP writes `.metadata.tmp` and renames it, which is a copy: the marker object
appears whole or not at all, after every shard, so the rule above holds there too.

Async saves run DCP in a background thread over a dedicated gloo group, so its
collectives never interleave with training's; the step waits only for the staging copy.
"""

from __future__ import annotations

import io
import json
import logging
import re
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from gpucloud import storage
from gpucloud.errors import ConfigError
from gpucloud.storage import Location

log = logging.getLogger(__name__)

COMMIT_MARKER = ".metadata"
_STEP_DIR = re.compile(r"^step-(\d+)$")


# The optimizer flattened to one entry per parameter and field, hyperparameters included
# ("optim.param_groups.model.norm.weight.lr"). Nested, each param group's list of parameter
# names is one entry ("optim.param_groups.0.params") with the same key on every rank: DCP
# keeps one rank's copy, so pipeline stages (which own different parameters) reloaded
# groups naming none of theirs, and AdamW then failed on the missing 'betas'.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
# What checkpoints written before the flat layout hold: still read, so runs of DDP and FSDP
# started then resume (pipeline runs never could).
NESTED = StateDictOptions()
_NESTED_GROUP = re.compile(r"^optim\.param_groups\.\d+\.")


def state_dict_of(
    model: nn.Module, optimizer: torch.optim.Optimizer, layout: StateDictOptions = FLAT
) -> dict[str, Any]:
    """`{"model": ..., "optim": ...}` of this rank's parameters, as a checkpoint stores it."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=layout)
    return {"model": model_sd, "optim": optim_sd}


def load_state_dict_into(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    layout: StateDictOptions = FLAT,
) -> None:
    """Put a `state_dict_of` (filled by `Checkpointer.load`) back into model and optimizer."""
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=layout,
    )


def layout_of(path: Location) -> StateDictOptions:
    """The optimizer layout a committed checkpoint was written in: FLAT, or NESTED for one
    written before (numbered param groups, "optim.param_groups.0.lr")."""
    nested = any(_NESTED_GROUP.match(key) for key in saved_keys(path))
    return NESTED if nested else FLAT


def step_dir(root: Location, step: int) -> Location:
    return storage.join(root, f"step-{step:08d}")


def committed(root: Location) -> list[tuple[int, Location]]:
    """(step, dir) of every committed checkpoint under `root`, oldest first."""
    found = [
        (int(_STEP_DIR.match(name).group(1)), storage.join(root, name))
        for name, done in _step_dirs(root).items()
        if done
    ]
    return sorted(found)


def _step_dirs(root: Location) -> dict[str, bool]:
    """Each step-N directory under `root` → whether it is committed."""
    entries = storage.files(root)
    listed = set(entries)
    return {name: f"{name}/{COMMIT_MARKER}" in listed for name in entries if _STEP_DIR.match(name)}


def latest(root: Location) -> Location | None:
    """The newest committed checkpoint, or None. Half-written directories are skipped."""
    found = committed(root)
    return found[-1][1] if found else None


def resolve(path: Location) -> Location:
    """A checkpoint dir, or a run/checkpoints dir meaning its newest committed checkpoint."""
    for candidate in (path, storage.join(path, "checkpoints")):
        if COMMIT_MARKER in storage.files(candidate):
            return candidate
        newest = latest(candidate)
        if newest is not None:
            return newest
    raise ConfigError(
        f"{path} holds no committed checkpoint (a step-N directory with {COMMIT_MARKER})"
    )


def saved_keys(path: Location) -> set[str]:
    """Flattened keys stored in a checkpoint (e.g. 'model.lm_head.weight')."""
    return set(reader(path).read_metadata().state_dict_metadata)


def reader(path: Location) -> dcp.StorageReader:
    """DCP's reader for a checkpoint dir: the file system's, or fsspec's for a URL."""
    if storage.is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(path, **storage.fs_options(path))
    return dcp.FileSystemReader(path)


def _writer(path: Location) -> dcp.StorageWriter:
    if storage.is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(path, **storage.fs_options(path))
    return dcp.FileSystemWriter(path)


class Checkpointer:
    """Saves and loads `step-N` checkpoints for one rank; prunes to the newest `keep`."""

    def __init__(self, root: Location, keep: int, async_save: bool):
        self.root, self.keep, self.async_save = root, keep, async_save
        self.rank = dist.get_rank()
        # Async DCP runs collectives from another thread: give it its own gloo group.
        self.group = dist.new_group(backend="gloo") if async_save else None
        # One stager for the whole run: it keeps its host buffers and copies into them, so
        # a save costs one memcpy instead of fresh allocations (page faults) every time.
        self.stager = _reusing_stager() if async_save else None
        self.pending: Future | None = None

    def save(self, step: int, tensors: dict[str, Any], extra: dict[str, Any]) -> None:
        """Write checkpoint `step`. Returns once the state may change again (staged)."""
        self.wait()
        path = step_dir(self.root, step)
        rng = io.BytesIO()
        torch.save(_rng_state(), rng)
        storage.write_bytes(storage.join(path, "rng", f"rank{self.rank}.pt"), rng.getvalue())
        if self.rank == 0:
            text = json.dumps(extra) + "\n"
            storage.write_bytes(storage.join(path, "train.json"), text.encode())
        if self.async_save:
            response = dcp.async_save(
                tensors,
                storage_writer=_writer(path),
                process_group=self.group,
                async_stager=self.stager,
            )
            if isinstance(response, Future):  # staged synchronously (CPU): upload pending
                self.pending = response
            else:  # staging runs in the background too: wait for it only
                response.staging_completion.result()
                self.pending = response.upload_completion
            self.pending.add_done_callback(lambda _: self._prune())
        else:
            dcp.save(tensors, storage_writer=_writer(path))
            self._prune()

    def wait(self) -> None:
        """Block until the previous async save is committed."""
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def close(self) -> None:
        """Wait for the last save and free the staging buffers."""
        self.wait()
        if self.stager is not None:
            self.stager.close()

    def load(self, path: Location, tensors: dict[str, Any]) -> dict[str, Any]:
        """Load shards into `tensors` in place, restore this rank's RNG; return train.json."""
        dcp.load(tensors, storage_reader=reader(path))
        rng_file = f"rng/rank{self.rank}.pt"
        if rng_file in storage.files(path):  # absent when resuming on more ranks than saved
            rng = storage.read_bytes(storage.join(path, rng_file))
            _set_rng_state(torch.load(io.BytesIO(rng), weights_only=False))
        return json.loads(storage.read_bytes(storage.join(path, "train.json")))

    def discard_uncommitted(self) -> None:
        """Remove crash leftovers (no commit marker) so a later save starts clean. Rank 0."""
        if self.rank != 0:
            return
        for name, done in _step_dirs(self.root).items():
            if not done:
                log.warning("removing uncommitted checkpoint %s", storage.join(self.root, name))
                storage.remove_tree(storage.join(self.root, name))

    def _prune(self) -> None:
        if self.rank != 0:
            return
        for _, old in committed(self.root)[: -self.keep]:
            storage.remove_tree(old)


def _reusing_stager():
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # No pinned/shared memory, no staging thread: those need an accelerator; on one the
    # copy to host is what the step waits for.
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )


def _rng_state() -> dict[str, Any]:
    from gpucloud.hal import device

    state = {"host": torch.get_rng_state()}
    backend = device.detect()
    if backend.name != "cpu":
        state[backend.name] = getattr(torch, backend.name).get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from gpucloud.hal import device

    torch.set_rng_state(state["host"])
    backend = device.detect()
    if backend.name in state:
        getattr(torch, backend.name).set_rng_state(state[backend.name])
