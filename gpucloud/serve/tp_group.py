"""The collectives of a tensor-parallel engine: one driver (rank 0) and its workers.

Ranks meet through a file store in a directory the driver made (no port to pick or to
collide). Tensors of the forward pass travel through the backend's collective library
(gloo on CPU, NCCL on CUDA, HCCL on Ascend, XCCL on Intel GPUs: `hal` says which); the
driver's messages to the workers (what to compute next) through a gloo group on the host.
A message is pickled with its tensors taken out of the pickle and sent as one flat buffer
per dtype: pickling tensors one by one costs more than a tiny model's decode step.

The group is built directly from the store rather than through `init_process_group`, so a
process can hold several engines (and the training code its own default group).
"""

from __future__ import annotations

import io
import pickle
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from gpucloud.errors import UserError
from gpucloud.hal import device as hal_device
from gpucloud.serve.config import EngineConfig

TIMEOUT = timedelta(minutes=10)  # a collective waits this long for a rank that stopped


def file_store(directory: Path, size: int) -> dist.Store:
    """The store the `size` ranks meet in (a file in `directory`, made by the driver)."""
    return dist.FileStore(str(directory / "store"), size)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r's device: device r of the backend (`config.device`'s, else hal's); on the
    CPU every rank shares the host."""
    device = torch.device(config.device) if config.device else hal_device.device(rank)
    if device.type == "cpu":
        return device
    return torch.device(device.type, rank)


class TensorParallelGroup:
    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device):
        backend = hal_device.get_backend(device.type)
        self.rank, self.size, self.device = rank, size, device
        self._host = dist.ProcessGroupGloo(dist.PrefixStore("host", store), rank, size, TIMEOUT)
        self._dev = self._host
        if backend.dist_backend != "gloo":  # NCCL, HCCL, XCCL: collectives of device tensors
            self._dev = device_group(backend.dist_backend, store, rank, size)
        # Off while the driver profiles memory alone, before the workers listen.
        self.active = False

    # ---- the forward pass's collectives --------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        if self.active:
            self._dev.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(x) for _ in range(self.size)]
        self._dev.allgather([out], [x]).wait()
        return out

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (as many on each), by rank."""
        mine = torch.tensor(values)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        self._host.allgather([out], [mine]).wait()
        return [t.tolist() for t in out]

    # ---- driver → workers ----------------------------------------------------------
    def send(self, message: object) -> None:
        """Broadcast a picklable `message` (tensors anywhere inside it) to the workers."""
        tensors: list[torch.Tensor] = []
        body = _dumps(message, tensors)
        layout = _layout(tensors)
        header = pickle.dumps((layout, body), protocol=pickle.HIGHEST_PROTOCOL)
        self._host.broadcast(torch.tensor([len(header)]), 0).wait()
        self._host.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8), 0).wait()
        for _, parts in layout:
            flat = torch.cat([tensors[i].reshape(-1) for i, _ in parts])
            if flat.numel():
                self._dev.broadcast(flat, 0).wait()

    def receive(self) -> object:
        """The driver's next message, its tensors on this rank's device (workers only)."""
        length = torch.zeros(1, dtype=torch.long)
        self._host.broadcast(length, 0).wait()
        header = torch.empty(int(length), dtype=torch.uint8)
        self._host.broadcast(header, 0).wait()
        layout, body = pickle.loads(header.numpy().tobytes())
        tensors: dict[int, torch.Tensor] = {}
        for dtype, parts in layout:
            sizes = [shape.numel() for _, shape in parts]
            flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
            if flat.numel():
                self._dev.broadcast(flat, 0).wait()
            for (i, shape), t in zip(parts, flat.split(sizes), strict=True):
                tensors[i] = t.view(shape)
        unpickler = pickle.Unpickler(io.BytesIO(body))
        unpickler.persistent_load = tensors.__getitem__
        return unpickler.load()


def device_group(name: str, store: dist.Store, rank: int, size: int) -> dist.ProcessGroup:
    """A process group of backend `name` over `store`: NCCL and XCCL are built into torch
    builds for their devices; out-of-tree backends (HCCL from torch_npu, or any other)
    come from the plugins registered with `dist.Backend.register_backend`.

    Raises UserError when this torch has no such backend."""
    prefix = dist.PrefixStore("device", store)
    if name == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        return dist.ProcessGroupNCCL(prefix, rank, size)
    if name == "xccl" and hasattr(dist, "ProcessGroupXCCL"):
        options = dist.ProcessGroupXCCL.Options()
        options._timeout = TIMEOUT
        return dist.ProcessGroupXCCL(prefix, rank, size, options)
    plugin = dist.Backend._plugins.get(name.upper())
    if plugin is None:
        raise UserError(
            f"tensor-parallel serving over {name}: this torch has no {name} backend "
            f"(backends here: {', '.join(_available())})"
        )
    if not plugin.extended_api:
        return plugin.creator_fn(prefix, rank, size, TIMEOUT)
    options = c10d._DistributedBackendOptions()
    options.store, options.group_rank, options.group_size = prefix, rank, size
    options.timeout, options.group_id = TIMEOUT, "tensor-parallel"
    options.global_ranks_in_group = list(range(size))
    return plugin.creator_fn(options, None)


def _available() -> list[str]:
    built_in = [n for n, cls in (("gloo", "ProcessGroupGloo"), ("nccl", "ProcessGroupNCCL"),
                                 ("xccl", "ProcessGroupXCCL")) if hasattr(dist, cls)]  # fmt: skip
    return built_in + [name.lower() for name in dist.Backend._plugins]


class _Pickler(pickle.Pickler):
    def __init__(self, file, tensors: list[torch.Tensor]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
            return len(self.tensors) - 1
        return None


def _dumps(message: object, tensors: list[torch.Tensor]) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, tensors).dump(message)
    return buf.getvalue()


def _layout(tensors: list[torch.Tensor]) -> list[tuple[torch.dtype, list]]:
    """Per dtype, in first-seen order: its tensors' (index, shape)."""
    groups: dict[torch.dtype, list] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append((i, t.shape))
    return list(groups.items())
