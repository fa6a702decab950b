"""What torchrun runs on every rank: `python -m gpucloud.train.worker --run-dir DIR`.

Reads the resolved config the launcher wrote, joins the process group on the backend hal
picks, trains, and (rank 0) records the outcome in `status.json` for the launcher. It
exits 0 for every planned outcome so torchrun restarts the group only after a crash.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
from pathlib import Path

import torch.distributed as dist

from gpucloud.hal import device as hal_device
from gpucloud.train import config
from gpucloud.train.trainer import DistEnv, Outcome, Trainer

STATUS_FILE = "status.json"
CONFIG_FILE = "config.json"


def init_distributed() -> DistEnv:
    """Join the group torchrun set up (env://) on this machine's backend."""
    backend = hal_device.detect()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    hal_device.set_device(local_rank, backend)
    dist.init_process_group(backend=backend.dist_backend)
    return DistEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=hal_device.device(local_rank, backend),
        backend=backend.name,
        attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )


def write_status(run_dir: Path, outcome: Outcome, step: int, attempt: int) -> None:
    status = {"outcome": outcome.value, "step": step, "attempt": attempt}
    tmp = run_dir / f"{STATUS_FILE}.tmp"
    tmp.write_text(json.dumps(status) + "\n")
    tmp.replace(run_dir / STATUS_FILE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack
    cfg = config.load_resolved(args.run_dir / CONFIG_FILE)
    env = init_distributed()
    logging.basicConfig(
        level=logging.INFO if env.rank == 0 else logging.WARNING,
        format=f"%(asctime)s rank{env.rank} %(levelname)s %(name)s: %(message)s",
    )
    try:
        trainer = Trainer(cfg, args.run_dir, env)
        outcome = trainer.train()
        if env.rank == 0:
            write_status(args.run_dir, outcome, trainer.step, env.attempt)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
