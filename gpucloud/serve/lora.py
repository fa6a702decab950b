"""Multi-LoRA serving: the adapters an engine knows, and which of them sit in its slots.

Every registered adapter is kept on the CPU; `max_loras` of them at a time are resident in
the model's LoRA layers (one slot each). The scheduler lets at most `max_loras` distinct
adapters run at once, so before each forward the adapters of the step's tokens always fit:
those not resident take the slot used longest ago by an adapter outside the step.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gpucloud.errors import UserError, unknown_name
from gpucloud.models.llama import LlamaForCausalLM
from gpucloud.models.lora import (
    LoraAdapter,
    Weights,
    install_lora_layers,
    load_adapter,
    load_slot,
)
from gpucloud.models.spec import ModelSpec
from gpucloud.models.tensor_parallel import Shard


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """Which adapter a request uses, in vLLM's shape: `LoRARequest("sql", 1, "/path")`. The
    engine loads `lora_path` under `lora_name` on first use; `lora_int_id` is accepted for
    vLLM's callers but adapters are told apart by name."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


class LoraManager:
    """The adapters of one engine. Under tensor parallelism `model` is rank 0's shard: the
    adapters are checked against `whole` (the unsharded model's spec), the shard's layers
    hold `shard`'s part of each, and `on_load(slot, weights)` (set by the driver) hands
    every slot load to the other ranks before the forward that needs it."""

    def __init__(
        self, model: LlamaForCausalLM, max_loras: int, max_lora_rank: int,
        whole: ModelSpec | None = None, shard: Shard | None = None,
    ):  # fmt: skip
        self.model, self.max_lora_rank = model, max_lora_rank
        self.whole, self.shard = whole or model.spec, shard
        self.on_load: Callable[[int, Weights], None] | None = None
        self.layers = install_lora_layers(model, max_loras, max_lora_rank)
        self.batch = model.lora_batch
        self.adapters: dict[str, LoraAdapter] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # the API thread registers while the engine resolves
        # Resident adapters, least recently used first: adapter id -> slot.
        self._slots: OrderedDict[int, int] = OrderedDict()
        self._free_slots = list(range(max_loras))

    # ---- registry (any thread) ---------------------------------------------------------------
    def add(self, name: str, path: str | Path) -> LoraAdapter:
        """Load and register the PEFT adapter at `path` as `name`. Raises ConfigError (bad
        adapter) or UserError (the name is taken)."""
        if name in self.adapters:
            raise UserError(f"LoRA adapter {name!r} is already loaded; unload it first")
        adapter = load_adapter(path, self.whole, self.max_lora_rank, name)
        adapter.id = next(self._ids)
        with self._lock:
            if name in self.adapters:
                raise UserError(f"LoRA adapter {name!r} is already loaded; unload it first")
            self.adapters[name] = adapter
        return adapter

    def remove(self, name: str) -> None:
        """Forget `name` (requests already queued with it finish with it). Raises
        NotFoundError."""
        with self._lock:
            if name not in self.adapters:
                raise unknown_name("LoRA adapter", name, self.adapters)
            del self.adapters[name]

    def resolve(self, request: LoRARequest | str) -> LoraAdapter:
        """The adapter a request names, loaded from its path on first use. Raises
        NotFoundError (an unknown name without a path) or ConfigError."""
        name = request if isinstance(request, str) else request.lora_name
        adapter = self.adapters.get(name)
        if adapter is not None:
            return adapter
        if isinstance(request, str) or not request.lora_path:
            raise unknown_name("LoRA adapter", name, self.adapters)
        return self.add(name, request.lora_path)

    # ---- the step (engine thread) ----------------------------------------------------------
    def set_batch(self, row_adapters: list[LoraAdapter | None], device: torch.device) -> None:
        """Make the step's adapters resident and tell the LoRA layers each row's slot."""
        rows: dict[int, list[int]] = {}
        adapters: dict[int, LoraAdapter] = {}
        for row, adapter in enumerate(row_adapters):
            if adapter is not None:
                rows.setdefault(adapter.id, []).append(row)
                adapters[adapter.id] = adapter
        slots = {i: self._slot(a, adapters) for i, a in adapters.items()}
        self.batch.groups = [
            (slots[i], torch.tensor(r, dtype=torch.long, device=device)) for i, r in rows.items()
        ]

    def clear_batch(self) -> None:
        self.batch.groups = []

    def _slot(self, adapter: LoraAdapter, in_step: dict[int, LoraAdapter]) -> int:
        slot = self._slots.get(adapter.id)
        if slot is not None:
            self._slots.move_to_end(adapter.id)
            return slot
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next(i for i in self._slots if i not in in_step)
            slot = self._slots.pop(victim)
        load_slot(self.layers, slot, adapter.weights, self.shard)
        if self.on_load is not None:
            self.on_load(slot, adapter.weights)
        self._slots[adapter.id] = slot
        return slot
