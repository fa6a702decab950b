"""What one server knows: its engine, settings, metrics and whether it is draining."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gpucloud.errors import unknown_name
from gpucloud.serve.api.bridge import EngineBridge
from gpucloud.serve.api.errors import APIError
from gpucloud.serve.api.metrics import ServerMetrics
from gpucloud.serve.api.startup import Startup
from gpucloud.serve.engine import LLMEngine

STALL_AFTER = 60.0  # seconds without an engine turn before /health reports a stall


@dataclass(slots=True)
class APISettings:
    model_name: str
    api_key: str | None = None  # None: no authentication
    max_waiting: int | None = None  # waiting sequences beyond which requests get 429
    max_body_bytes: int = 8 << 20  # larger bodies get 413 (gpucloud.http_body)
    # /v1/load_lora_adapter and /v1/unload_lora_adapter: off unless asked for, since they
    # read any path the server can.
    runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        from gpucloud.errors import ConfigError

        if not self.model_name:
            raise ConfigError("served model name must not be empty")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ConfigError("max_waiting must be >= 0")
        if self.max_body_bytes < 1:
            raise ConfigError("max_body_bytes must be >= 1")


@dataclass(eq=False)
class ServerState:
    engine: LLMEngine
    settings: APISettings
    startup: Startup
    metrics: ServerMetrics = field(init=False)
    bridge: EngineBridge = field(init=False)
    started: bool = False
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.engine, self.settings.model_name, self.startup)
        self.bridge = EngineBridge(self.engine, self.metrics.observe)

    @property
    def ready(self) -> bool:
        return self.started and not self.draining and self.bridge.healthy(STALL_AFTER)

    def check_model(self, name: str) -> str | None:
        """The LoRA adapter `name` selects, or None for the served model itself. Raises
        NotFoundError (404) for any other name."""
        if name == self.settings.model_name:
            return None
        adapters = [a.name for a in self.engine.list_loras()]
        if name not in adapters:
            raise unknown_name("model", name, [self.settings.model_name, *adapters])
        return name

    def admit(self) -> None:
        """Refuse new work while draining (503) or when too many sequences wait (429).
        Called right before submitting, with no await in between, so the count is exact."""
        if self.draining:
            self.metrics.reject("draining")
            raise APIError(503, "the server is shutting down; retry on another replica",
                           "server_draining")  # fmt: skip
        limit = self.settings.max_waiting
        if limit is not None and self.engine.stats().num_waiting >= limit:
            self.metrics.reject("queue_full")
            raise APIError(
                429,
                f"the server is overloaded: {limit} requests are already waiting; retry later",
                "server_overloaded",
                headers={"Retry-After": "1"},
            )
