"""The validation loss of a training run: the mean next-token loss over a fixed set of
windows of the prepared dataset's `val` split.

Each data-parallel rank scores its own windows (the same ones at every evaluation) and the
mean is all-reduced, so every rank returns the same number. Scoring runs without gradients
and draws no random numbers: a run with evaluations trains exactly as one without.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from gpucloud.train.config import Layout, RunConfig
from gpucloud.train.data import DatasetInfo, TokenWindows
from gpucloud.train.parallel import loss_fn


class Validation:
    def __init__(self, info: DatasetInfo, cfg: RunConfig, lay: Layout, dp_rank: int):
        """Raises ConfigError when the val split holds less than one sequence."""
        self.windows = TokenWindows(info, cfg.data.seq_len, cfg.data.seed, split="val")
        self.every, self.max_steps = cfg.eval.every, cfg.optim.max_steps
        self.batches, self.micro_batch = cfg.eval.batches, lay.micro_batch
        self.loss_ranks = lay.loss_ranks
        self.first = dp_rank * self.batches * self.micro_batch

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.max_steps

    @torch.no_grad()
    def loss(self, module: torch.nn.Module, device: torch.device, autocast=None) -> float:
        """The mean loss over every rank's windows (a collective: all ranks call it)."""
        training = module.training
        module.eval()
        total = torch.zeros((), dtype=torch.float32, device=device)
        for b in range(self.batches):
            start = self.first + b * self.micro_batch
            tokens = torch.from_numpy(self.windows.batch(start, self.micro_batch)).to(device)
            with autocast or contextlib.nullcontext():
                logits = module(tokens[:, :-1])
            total += loss_fn(logits, tokens[:, 1:])
        module.train(training)
        dist.all_reduce(total)
        return total.item() / (self.loss_ranks * self.batches)
