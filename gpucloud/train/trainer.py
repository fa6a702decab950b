"""The training loop of one rank: restore → loop(step) → save.

A step reads its samples as a pure function of (seed, step), runs the micro-batches with
gradient sync on the last one only, all-reduces the loss (so every rank agrees on NaN),
measures the global grad norm, asks `HealthMonitor` what to do, then updates. Nothing
here knows which strategy runs underneath; `parallel.Parallel` hides that.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path

import torch
import torch.distributed as dist

from gpucloud.hal import device as hal_device
from gpucloud.models.llama import LlamaForCausalLM
from gpucloud.models.spec import ModelSpec
from gpucloud.train import checkpoint, moe, parallel, recipes, stragglers
from gpucloud.train.config import Layout, OptimConfig, RunConfig, layout
from gpucloud.train.data import first_sample
from gpucloud.train.faults import Faults
from gpucloud.train.health import Action, HealthMonitor, LossScaler, Verdict
from gpucloud.train.launcher import write_status
from gpucloud.train.metrics import MetricsLog, StepClock, memory_bytes, mfu
from gpucloud.train.profiling import StepProfiler
from gpucloud.train.validation import Validation

log = logging.getLogger(__name__)


class Outcome(StrEnum):
    COMPLETED = "completed"
    STOPPED = "stopped"  # the health policy ended the run
    TERMINATED = "terminated"  # SIGTERM: saved a checkpoint and left; resumable
    HUNG = "hung"  # a step outlived health.hang_timeout_s (stragglers.RankWatch); resumable


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # hal backend name
    attempt: int  # torchrun restart count: 0 on the first start
    store: dist.Store | None = None  # the rendezvous store: where ranks mark their progress


def lr_at(step: int, o: OptimConfig) -> float:
    """Linear warmup to `lr` over `warmup_steps`, then cosine decay to `min_lr`."""
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(o.max_steps - o.warmup_steps, 1)
    progress = min((step - o.warmup_steps) / span, 1.0)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress))


def build_model(cfg: RunConfig) -> LlamaForCausalLM:
    """The model on CPU in fp32: a seeded preset init, or the weights of `model.path`; with
    `[lora]`, frozen (weight-only quantized for QLoRA) with trainable adapters added."""
    if cfg.model.path is None:
        from gpucloud.models.presets import resolve_spec

        model = LlamaForCausalLM(resolve_spec(cfg.model.preset))
        model.init_weights(cfg.model.seed)
        return model
    from gpucloud.models.loader import load_model

    quantization = cfg.lora.base_quantization if cfg.lora else None
    model = load_model(cfg.model.path, dtype=torch.float32, quantization=quantization)
    if cfg.lora is not None:
        from gpucloud.train.lora_train import add_lora

        add_lora(model, cfg.lora, cfg.model.seed)
    return model


def build_optimizer(model: torch.nn.Module, o: OptimConfig) -> torch.optim.AdamW:
    # No weight decay on norms and biases (1-D tensors), as is standard for transformers.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: Path, env: DistEnv):
        self.cfg, self.run_dir, self.env = cfg, run_dir, env
        self.lay: Layout = layout(cfg, env.world_size)
        torch.manual_seed(cfg.data.seed + env.rank)
        model = build_model(cfg).to(env.device).train()  # a loaded model comes in eval mode
        self.spec: ModelSpec = model.spec
        self.moe = moe.MoeTraining(cfg.moe, model)
        self.recipe = recipes.build(cfg, model)
        dp_rank = self.lay.dp_rank(env.rank)
        self.validation = (
            Validation(self.recipe.info, cfg, self.lay, dp_rank) if cfg.eval.every else None
        )  # eval.every is for pretrain runs only (config.RunConfig checks)
        self.scaler = LossScaler(cfg.precision.dtype == "fp16")
        self.par = parallel.build(model, cfg, self.lay, env.device, self._loss)
        self.opt = build_optimizer(self.par.model, cfg.optim)
        self.ckpt = checkpoint.Checkpointer(
            cfg.checkpoint_dir(run_dir), cfg.checkpoint.keep, cfg.checkpoint.async_save
        )
        self.health = HealthMonitor(cfg.health)
        self.metrics = MetricsLog(run_dir, env.rank == 0, cfg.logging.metrics_port)
        self.watch = stragglers.RankWatch(
            cfg.health, env.rank, env.world_size, env.store, self.lay.pp == 1, self._hung
        )
        self.faults = Faults(cfg.fault, env.rank, env.attempt)
        self.clock = StepClock()
        self.profiler = StepProfiler(
            cfg.logging.profile_range, run_dir, env.backend, enabled=env.rank == 0
        )
        # Seconds this step spent reading its batches and in the collectives after backward
        # (grad norm, loss and stop flag): `gpucloud doctor --job` weighs them against the step;
        # and in its forward passes: with the batches, this rank's own work (stragglers.py)
        self._data_s = self._sync_s = self._forward_s = 0.0
        self.step = 0  # optimizer steps done; step s (1-based) reads the data of index s - 1
        self.skip_steps: set[int] = set()  # steps whose data is skipped after a rollback
        self.rollbacks = 0
        self.terminate = False
        self._peak = self._peak_flops()
        self._flops_per_token = self.spec.flops_per_token(cfg.data.seq_len)

    # ---- the loop --------------------------------------------------------------------
    def train(self) -> Outcome:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.restore()
        outcome = Outcome.COMPLETED
        while self.step < self.cfg.optim.max_steps:
            self.watch.start_step(self.step + 1)
            self.faults.hang_before(self.step + 1)
            with self.profiler.step(self.step + 1):
                verdict, stop_asked = self.train_step()
            self.watch.end_step()
            if verdict.action is Action.STOP:
                outcome = Outcome.STOPPED
                break
            if verdict.action is Action.ROLLBACK:
                if not self.rollback():
                    outcome = Outcome.STOPPED
                    break
                continue
            if stop_asked:
                self.save()
                outcome = Outcome.TERMINATED
                break
            if self.validation is not None and self.validation.due(self.step):
                self.validate()
            if self.step % self.cfg.checkpoint.every == 0 or self.step == self.cfg.optim.max_steps:
                self.save()
            self.faults.kill_after(self.step)
        self.watch.close()
        self.ckpt.close()
        self.profiler.close()
        self.metrics.write({"step": self.step, "event": outcome.value})
        self.metrics.close()
        return outcome

    def train_step(self) -> tuple[Verdict, bool]:
        """One optimizer step (or a skip). Returns the health verdict and whether any rank
        asked to stop (SIGTERM), both agreed across ranks."""
        t0 = time.perf_counter()
        self._data_s = self._forward_s = 0.0
        index = self.step  # 0-based data index of this step
        if index + 1 in self.skip_steps:
            self.step += 1
            self.metrics.write({"step": self.step, "event": "skip_data"})
            return Verdict(Action.OK), self._any_rank(self.terminate)
        lr = lr_at(index, self.cfg.optim)
        for group in self.opt.param_groups:
            group["lr"] = lr
        local_loss = self._forward_backward(index)
        t_sync = time.perf_counter()
        self.par.after_backward()
        # The loss is only for the log and the stop flag only acts after this step: reduce
        # them in the background while the update runs. The verdict cannot wait: it uses the
        # global grad norm, non-finite on every rank as soon as any rank's loss is (NaN
        # propagates through the gradient reduction), plus this rank's own loss.
        flag = torch.tensor(float(self.terminate), dtype=torch.float64)
        own = self.watch.slots(self._data_s + self._forward_s)
        stats = torch.cat([local_loss.detach().double().cpu().view(1), flag.view(1), own])
        stats = stats.to(self.env.device)
        reduction = dist.all_reduce(stats, async_op=True)
        norm = parallel.grad_norm(self.par).item() / self.scaler.scale
        self._sync_s = time.perf_counter() - t_sync
        local = local_loss.item()
        verdict = self.health.check(local, norm, overflow_expected=self.scaler.enabled)
        if verdict.action is Action.OK:
            clip = self.cfg.optim.grad_clip
            coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
            parallel.scale_grads(self.par, coef / self.scaler.scale)
            self.opt.step()
        self.scaler.update(overflow=verdict.reason == "overflow")
        self.opt.zero_grad(set_to_none=True)
        t_wait = time.perf_counter()
        reduction.wait()
        self._sync_s += time.perf_counter() - t_wait
        stats = stats.cpu()
        loss, stop_asked = stats[0].item() / self.lay.loss_ranks, bool(stats[1].item() > 0)
        for record in self.watch.observe(index + 1, stats[2:].tolist()):
            self.metrics.write(record)
        if verdict.action in (Action.OK, Action.SKIP):
            self.step += 1
        hal_device.synchronize()
        self._log(index + 1, loss, norm, lr, time.perf_counter() - t0, verdict)
        return verdict, stop_asked

    def _forward_backward(self, index: int) -> torch.Tensor:
        """Run this rank's micro-batches of step `index`; returns its mean loss, a 0-d
        tensor (0 off the last pipeline stage)."""
        lay, cfg = self.lay, self.cfg
        if self.par.schedule is not None:
            return self._pipeline_step(index)
        total = torch.zeros((), device=self.env.device)
        for micro in range(lay.accum):
            start = first_sample(
                index, micro, lay.dp_rank(self.env.rank), global_batch=cfg.global_batch, dp=lay.dp,
                mb=lay.micro_batch,
            )  # fmt: skip
            batch = self._batch(start, lay.micro_batch)
            last = micro == lay.accum - 1
            with contextlib.nullcontext() if last else self.par.no_sync(), self._autocast():
                t_forward = time.perf_counter()
                self.faults.lag()
                loss = self._scaled(self.recipe.loss(self.par.module, batch))
                self._forward_s += time.perf_counter() - t_forward
                if last:  # next: the backward with the gradients' collectives
                    self.watch.forward_done(index + 1)
                # The mean of micro-batch means: the batch mean when micro-batches hold the
                # same token count (pre-training; SFT weighs each micro-batch alike). The
                # scaled loss is undone on the grads before the update. MoE's balance term
                # trains the routers but is not part of the logged loss.
                balance = self.moe.penalty() * self.scaler.scale
                ((loss + balance) / lay.accum).backward()
            total += loss.detach().float()
        return total / (self.scaler.scale * lay.accum)

    def _pipeline_step(self, index: int) -> torch.Tensor:
        """Run this rank's stage over its replica's share of step `index`'s samples."""
        per_replica = self.cfg.global_batch // self.lay.dp
        first = index * self.cfg.global_batch + self.lay.dp_rank(self.env.rank) * per_replica
        tokens = self._batch(first, per_replica)["tokens"]
        losses: list[torch.Tensor] = []
        with self._autocast():
            if self.par.is_first_stage:
                self.par.schedule.step(tokens[:, :-1])
            elif self.par.is_last_stage:
                self.par.schedule.step(target=tokens[:, 1:], losses=losses)
            else:
                self.par.schedule.step()
        if not losses:
            return torch.zeros((), device=self.env.device)
        return torch.stack(losses).float().mean() / self.scaler.scale

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A pipeline's last stage's loss of a micro-batch."""
        return self._scaled(parallel.loss_fn(logits, targets))

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        loss = loss * self.scaler.scale
        fault = self.cfg.fault
        if fault.nan_at_step == self.step + 1 and self.env.attempt == 0 and self._holds_loss():
            loss = loss * float("nan")
        return loss

    def _holds_loss(self) -> bool:
        return self.par.is_last_stage if self.lay.pp > 1 else self.env.rank == 0

    def validate(self) -> None:
        """Log `val_loss` beside this step's training loss."""
        loss = self.validation.loss(self.par.module, self.env.device, self._autocast())
        self.metrics.write({"step": self.step, "val_loss": loss})

    # ---- checkpoints -------------------------------------------------------------------
    def restore(self) -> None:
        self.ckpt.discard_uncommitted()
        dist.barrier()
        path = checkpoint.latest(self.ckpt.root)
        if path is None:
            return
        self._load(path)
        self.metrics.write({"step": self.step, "event": "resume", "attempt": self.env.attempt})
        log.info("resumed from %s (attempt %d)", path, self.env.attempt)

    def rollback(self) -> bool:
        """Reload the newest checkpoint and mark the bad step's data to be skipped."""
        self.ckpt.wait()
        path = checkpoint.latest(self.ckpt.root)
        bad_step = self.step + 1
        self.rollbacks += 1
        if path is None or self.rollbacks > self.cfg.health.max_rollbacks:
            why = "no committed checkpoint" if path is None else "too many rollbacks"
            self.metrics.write({"step": self.step, "event": "rollback_failed", "reason": why})
            return False
        self.skip_steps.add(bad_step)
        self._load(path)
        self.metrics.write({"step": self.step, "event": "rollback", "bad_step": bad_step})
        return True

    def save(self) -> None:
        extra = {
            "step": self.step,
            "samples_consumed": self.step * self.cfg.global_batch,
            "data_seed": self.cfg.data.seed,
            "world_size": self.env.world_size,
            "loss_scaler": self.scaler.state_dict(),
            "skip_steps": sorted(self.skip_steps),
            "rollbacks": self.rollbacks,
            "health_window": list(self.health.recent),
            "model_config": self._export_spec().to_hf_config(),
            "tokenizer": self.recipe.tokenizer_dir,
        }
        if self.cfg.lora is not None:
            from gpucloud.train.lora_train import adapter_info

            extra["adapter"] = adapter_info(self.cfg)
        self.ckpt.save(self.step, checkpoint.state_dict_of(self.par.model, self.opt), extra)

    def _load(self, path: checkpoint.Location) -> None:
        layout = checkpoint.layout_of(path)
        state = checkpoint.state_dict_of(self.par.model, self.opt, layout)
        extra = self.ckpt.load(path, state)
        checkpoint.load_state_dict_into(self.par.model, self.opt, state, layout)
        self.step = extra["step"]
        self.scaler.load_state_dict(extra["loss_scaler"])
        # Keep skips decided after this checkpoint was written (a rollback's bad step).
        self.skip_steps |= set(extra["skip_steps"])
        self.rollbacks = max(self.rollbacks, extra["rollbacks"])
        self.health.recent.clear()
        self.health.recent.extend(extra["health_window"])

    def _export_spec(self) -> ModelSpec:
        """The spec with the tokenizer's bos/eos ids, so an exported model generates right."""
        tok_dir = self.recipe.tokenizer_dir
        if not tok_dir or not (Path(tok_dir) / "tokenizer.json").is_file():
            return self.spec
        from gpucloud.models.tokenizer import load_tokenizer

        tok = load_tokenizer(tok_dir)
        return replace(self.spec, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)

    # ---- helpers -----------------------------------------------------------------------
    def _batch(self, start: int, count: int) -> recipes.Batch:
        t0 = time.perf_counter()
        batch = recipes.to_device(self.recipe.batch(start, count), self.env.device)
        self._data_s += time.perf_counter() - t0
        return batch

    def _autocast(self):
        dtype = parallel.DTYPES[self.cfg.precision.dtype]
        # FSDP2 casts parameters itself (MixedPrecisionPolicy); others use autocast.
        if dtype == torch.float32 or self.cfg.parallel.strategy == "fsdp":
            return contextlib.nullcontext()
        return torch.autocast(self.env.device.type, dtype=dtype)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.env.device)
        dist.all_reduce(t)
        return t.cpu()

    def _any_rank(self, flag: bool) -> bool:
        return bool(self._all_reduce(torch.tensor([float(flag)]))[0].item() > 0)

    def _on_sigterm(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        # Finish the step, save, leave. A second SIGTERM kills at once (e.g. a hung peer).
        self.terminate = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _hung(self, record: dict) -> None:
        """Called by the hang watchdog's thread just before the process exits."""
        self.metrics.write(record)
        write_status(self.run_dir, Outcome.HUNG, self.step, self.env.attempt, self.env.rank)

    def _peak_flops(self) -> float | None:
        lc = self.cfg.logging
        if lc.peak_tflops:
            return lc.peak_tflops * 1e12
        if lc.accelerator:
            from gpucloud import hardware

            return hardware.get(lc.accelerator).bf16_flops
        return None

    def _log(self, step: int, loss: float, norm: float, lr: float, seconds: float, verdict):
        self.clock.add(seconds)
        last = step == self.cfg.optim.max_steps
        if verdict.action is Action.OK and step % self.cfg.logging.every and not last:
            return
        tokens_per_s = self.cfg.global_batch * self.cfg.data.seq_len / seconds
        record = {
            "step": step,
            "loss": loss,
            "grad_norm": norm,
            "lr": lr,
            "tokens_per_s": tokens_per_s,
            "step_time_s": seconds,
            "data_time_s": self._data_s,
            "sync_time_s": self._sync_s,
            "eta_s": self.clock.seconds_left(self.cfg.optim.max_steps - step),
            "mfu": mfu(tokens_per_s, self._flops_per_token, self._peak, self.env.world_size),
            "memory_bytes": memory_bytes(self.env.backend, self.env.local_rank),
        }
        if self.scaler.enabled:
            record["loss_scale"] = self.scaler.scale
        if self.watch.timed:
            record["stragglers"] = self.watch.stragglers
        record |= self.moe.stats()
        if verdict.action is not Action.OK:
            record |= {"event": verdict.action.value, "reason": verdict.reason}
        self.metrics.write(record)
