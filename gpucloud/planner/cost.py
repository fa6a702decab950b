"""Money: GPU-hours × the catalog's (or the user's) price per GPU-hour."""

from __future__ import annotations

from dataclasses import dataclass

from gpucloud.hardware import Accelerator


@dataclass(frozen=True)
class TrainCost:
    tokens: float  # the token budget
    time_s: float
    gpu_hours: float
    usd: float


def train_cost(tokens: float, tokens_per_s: float, gpus: int, gpu: Accelerator) -> TrainCost:
    """Time and dollars to train on `tokens` at `tokens_per_s` on `gpus` GPUs of type `gpu`."""
    time_s = tokens / tokens_per_s
    gpu_hours = time_s / 3600 * gpus
    return TrainCost(tokens, time_s, gpu_hours, gpu_hours * gpu.price_per_hour)


@dataclass(frozen=True)
class ServeCost:
    usd_per_hour: float
    usd_per_million_tokens: float  # generated tokens, at the decode rate given


def serve_cost(tokens_per_s: float, gpus: int, gpu: Accelerator) -> ServeCost:
    per_hour = gpus * gpu.price_per_hour
    return ServeCost(per_hour, per_hour / (tokens_per_s * 3600) * 1e6)
