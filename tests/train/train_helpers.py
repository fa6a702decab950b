"""Plain helpers for the training tests (fixtures live in conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpucloud.train import config

GPUCLOUD = [sys.executable, "-c", "from gpucloud.cli.main import app; app()"]


def run_config(dataset: Path, *overrides: str) -> dict:
    """A small real run: tiny preset, 32-token sequences, 8 sequences per step."""
    data = {
        "model": {"preset": "tiny"},
        "data": {"path": str(dataset), "seq_len": 32},
        "optim": {"global_batch": 8, "micro_batch": 2, "lr": 3e-3, "warmup_steps": 2,
                  "max_steps": 8},
        "checkpoint": {"every": 4},
    }  # fmt: skip
    for item in overrides:
        config.apply_override(data, item)
    return data


def write_toml(data: dict, path: Path) -> Path:
    lines = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_in_process(data: dict, run_dir: Path):
    """Train `data` on one rank in this process (a gloo group must exist: the
    `process_group` fixture) → (outcome, metrics records, trainer)."""
    import torch

    from gpucloud.train.trainer import DistEnv, Trainer

    run_dir.mkdir(parents=True, exist_ok=True)
    env = DistEnv(0, 1, 0, torch.device("cpu"), "cpu", attempt=0)
    trainer = Trainer(config.parse(data), run_dir, env)
    outcome = trainer.train()
    return outcome, read_metrics(run_dir), trainer


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(records: list[dict]) -> dict[int, float]:
    """Loss per step; a step logged twice (replayed after a resume) keeps its last value."""
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def gpucloud(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*GPUCLOUD, *args], capture_output=True, text=True, timeout=timeout, **kw)
