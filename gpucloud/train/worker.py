"""What torchrun runs on every rank: `python -m gpucloud.train.worker --run-dir DIR`.

Reads the resolved config the launcher wrote, joins the process group on the backend hal
picks, trains, and (rank 0) records the outcome in `status.json` for the launcher. It
exits 0 for every planned outcome so torchrun restarts the group only after a crash, or a
hang (`stragglers.HUNG_EXIT`: the group restarts from the last checkpoint).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from gpucloud.hal import device as hal_device
from gpucloud.train import config
from gpucloud.train.launcher import CONFIG_FILE, write_status
from gpucloud.train.trainer import DistEnv, Trainer


def init_distributed(hang_timeout_s: float) -> DistEnv:
    """Join the group torchrun set up (env://) on this machine's backend."""
    backend = hal_device.detect()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    hal_device.set_device(local_rank, backend)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = _store(attempt)
    # The collectives' own timeout only as a backstop: the hang watchdog reports first.
    timeout = timedelta(seconds=hang_timeout_s + 60)
    dist.init_process_group(
        backend=backend.dist_backend, store=store, rank=rank, world_size=world_size,
        timeout=timeout,
    )  # fmt: skip
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=hal_device.device(local_rank, backend),
        backend=backend.name,
        attempt=attempt,
        store=store,
    )


def _store(attempt: int) -> dist.Store:
    """The agent's TCPStore, under a prefix of its own per restart attempt.

    torchrun keeps one store across in-place restarts; gloo's connection keys written by
    the dead attempt would otherwise be read by the new one, whose group creation then
    waits forever for peers that no longer exist (seen here with a second gloo group).
    """
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        and os.environ["RANK"] == "0",
        timeout=timedelta(minutes=10),
    )
    return dist.PrefixStore(f"gpucloud/attempt-{attempt}", store)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack
    cfg = config.load_resolved(args.run_dir / CONFIG_FILE)
    env = init_distributed(cfg.health.hang_timeout_s)
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
