"""Wrap a model for the configured layout: DDP, FSDP2 (`fully_shard`) or pipeline stages,
and tensor parallel (`tp.py`) alone or inside the last two, over one device mesh (pp, dp, tp).

Each strategy returns a `Parallel`: the module to run, the plain model underneath (whose
state dict is the checkpoint's), the parameters this rank owns, and how gradients sync.
Collectives come from torch.distributed; this module only decides how they are arranged.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh

from gpucloud.models.llama import LlamaForCausalLM
from gpucloud.models.spec import ModelSpec
from gpucloud.train.config import Layout, RunConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Parallel:
    module: nn.Module
    """What the step calls: the DDP/FSDP module, or the pipeline stage's module."""
    model: nn.Module
    """The model (or this stage's part of it) whose FQNs name checkpoint entries."""
    sharded_grads: bool
    """Each rank holds a different part of the gradients: the norm needs an all-reduce."""
    schedule: object | None = None
    """Pipeline schedule (`torch.distributed.pipelining`), else None."""
    is_first_stage: bool = True
    is_last_stage: bool = True
    no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    after_backward: Callable[[], None] = lambda: None
    norm_excluded: set[nn.Parameter] = field(default_factory=set)
    """Parameters whose gradient another rank already counts in the norm (tied weights)."""
    norm_group: dist.ProcessGroup | None = None
    """Sharded grads: the ranks that together hold each gradient once (None: all ranks)."""

    def grad_params(self) -> Iterator[nn.Parameter]:
        return (p for p in self.model.parameters() if p.grad is not None)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, computed in fp32 (the planner models exactly this)."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def checkpoint_layers(layers: nn.Module) -> None:
    """Recompute each decoder layer in backward instead of keeping its activations."""
    for name, layer in list(layers.named_children()):
        layers.register_module(name, checkpoint_wrapper(layer))


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build(
    model: LlamaForCausalLM, cfg: RunConfig, lay: Layout, device: torch.device, loss: LossFn
) -> Parallel:
    """Arrange `model` (already on `device`, fp32) for `cfg.parallel` over `lay`. `loss` is
    what a pipeline's last stage computes per micro-batch."""
    mesh = device_mesh(lay, device) if lay.tp > 1 or lay.pp > 1 else None
    if lay.pp > 1:
        return _pipeline(model, cfg, lay, device, loss, mesh)
    if mesh is not None:
        from gpucloud.train import tp

        tp.parallelize(model, mesh["tp"])
    if cfg.parallel.activation_checkpointing:
        checkpoint_layers(model.model.layers)
    if cfg.parallel.strategy == "fsdp":
        return _fsdp(model, cfg, mesh["dp"] if mesh is not None else None)
    if mesh is not None:  # tensor parallel alone (no data-parallel ranks: `layout` checks)
        return Parallel(
            module=model,
            model=model,
            sharded_grads=True,
            after_backward=lambda: _shard_grads_like_params(model),
        )
    return _ddp(model, device)


def device_mesh(lay: Layout, device: torch.device) -> DeviceMesh:
    """The ranks as a (pp, dp, tp) grid, tp innermost so a tensor-parallel group is
    neighbouring ranks (one node's fast links), pp outermost. Built once per run: each
    dimension's process groups are created here."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (lay.pp, lay.dp, lay.tp)
    return init_device_mesh(device.type, shape, mesh_dim_names=("pp", "dp", "tp"))


def _ddp(model: nn.Module, device: torch.device) -> Parallel:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = None if device.type == "cpu" else [device.index]
    # The only buffer is RoPE's constant inv_freq: nothing to re-broadcast before each forward.
    ddp = DDP(model, device_ids=ids, forward_sync_buffers=False)
    return Parallel(module=ddp, model=model, sharded_grads=False, no_sync=ddp.no_sync)


def _fsdp(model: LlamaForCausalLM, cfg: RunConfig, mesh: DeviceMesh | None) -> Parallel:
    """FSDP2 over `mesh` (the data-parallel dimension of a 2D mesh), or over every rank."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    compute = DTYPES[cfg.precision.dtype]
    mp = MixedPrecisionPolicy(
        param_dtype=None if compute == torch.float32 else compute, reduce_dtype=torch.float32
    )
    # Pinned host memory speeds the copies to an accelerator; a CPU run has none to pin for.
    pin = next(model.parameters()).device.type != "cpu"
    off = CPUOffloadPolicy(pin_memory=pin) if cfg.parallel.offload_optimizer else OffloadPolicy()
    reshard = cfg.parallel.reshard_after_forward
    for layer in model.model.layers:
        fully_shard(
            layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=off
        )
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=off)

    @contextlib.contextmanager
    def no_sync():
        # FSDP2's equivalent of DDP.no_sync: keep unsharded grads, skip the reduce-scatter.
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    return Parallel(module=model, model=model, sharded_grads=True, no_sync=no_sync)


class _Stage(nn.Module):
    """One pipeline stage: embeddings on the first, norm + LM head on the last."""

    def __init__(self, model: LlamaForCausalLM, seq_shards: int):
        super().__init__()
        self.inner = model
        self.seq_shards = seq_shards
        """Tensor parallel: stages pass on a slice of the sequence (sequence parallel)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.inner
        tokens = m.model.embed_tokens is not None
        seq = x.shape[1] if tokens else x.shape[1] * self.seq_shards
        cos, sin = m.rope(torch.arange(seq, device=x.device).expand(x.shape[0], seq))
        h = m.model.embed_tokens(x) if tokens else x
        for layer in m.model.layers.values():
            h = layer(h, cos, sin, m.causal_attention)
        return m.lm_head(m.model.norm(h)) if m.lm_head is not None else h


def _pipeline(
    model: LlamaForCausalLM,
    cfg: RunConfig,
    lay: Layout,
    device: torch.device,
    loss: LossFn,
    mesh: DeviceMesh,
) -> Parallel:
    """This rank's stage of its data-parallel replica's pipeline (PP × DP)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage, pp = mesh["pp"].get_local_rank(), lay.pp
    first, last = stage == 0, stage == pp - 1
    per_stage = model.spec.num_hidden_layers // pp
    owned = range(stage * per_stage, (stage + 1) * per_stage)
    tied = model.spec.tie_word_embeddings
    # A ModuleDict keyed by the original index keeps HF names (model.layers.5.…) per stage.
    model.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in owned})
    if not first:
        model.model.embed_tokens = None
    if not last:
        model.model.norm = None
        model.lm_head = None
    if lay.tp > 1:
        from gpucloud.train import tp

        tp.parallelize(model, mesh["tp"])
    if cfg.parallel.activation_checkpointing:
        checkpoint_layers(model.model.layers)
    # Tied embeddings live on the first and the last stage; their grads are summed across
    # the two after backward so both copies take the same update (Megatron does the same).
    tie_group = _first_and_last_stages(mesh) if tied else None
    tied_param = None
    if tied and (first or last):
        tied_param = model.model.embed_tokens.weight if first else model.lm_head.weight

    def after_backward() -> None:
        if lay.tp > 1:
            _shard_grads_like_params(model)
        if lay.dp > 1:
            _average_grads(model, mesh["dp"].get_group(), lay.dp)
        if tied_param is not None and tied_param.grad is not None:
            dist.all_reduce(_local(tied_param.grad), group=tie_group)

    stage_module = _Stage(model, seq_shards=lay.tp)
    io = _stage_io(cfg, lay, model.spec, first, last) if lay.tp > 1 else {}
    group = mesh["pp"].get_group()
    pipe_stage = PipelineStage(stage_module, stage, pp, device, group=group, **io)
    kind = ScheduleGPipe if cfg.parallel.pipeline_schedule == "gpipe" else Schedule1F1B
    schedule = kind(pipe_stage, n_microbatches=lay.accum, loss_fn=loss)
    return Parallel(
        module=pipe_stage.submod,
        model=model,
        sharded_grads=True,
        schedule=schedule,
        is_first_stage=first,
        is_last_stage=last,
        after_backward=after_backward,
        norm_excluded={tied_param} if tied and last and pp > 1 else set(),
        norm_group=_replica(mesh),  # a stage's replicas hold the same gradients
    )


def _shard_grads_like_params(model: nn.Module) -> None:
    """Give each tensor-parallel gradient its parameter's placement. The embedding's comes
    back whole on every rank (Replicate) for a vocabulary-sharded weight; its shard is a
    local slice, no communication. (Under FSDP2 the reduce-scatter does this.)"""
    for p in model.parameters():
        placements = getattr(p, "placements", None)
        if p.grad is not None and placements is not None and p.grad.placements != placements:
            p.grad = p.grad.redistribute(placements=placements)


def _stage_io(cfg: RunConfig, lay: Layout, spec: ModelSpec, first: bool, last: bool) -> dict:
    """What a stage receives and sends, given up front under tensor parallel: stages pass
    a slice of the sequence (sequence parallel), which torch's shape inference, run on the
    whole sequence, does not know."""
    mb, seq, meta = lay.micro_batch, cfg.data.seq_len, torch.device("meta")
    dtype = DTYPES[cfg.precision.dtype]
    # requires_grad: what carries a gradient back (torch derives the gradients' metadata).
    hidden = torch.empty(mb, seq // lay.tp, spec.hidden_size, device=meta, requires_grad=True)
    tokens = torch.empty(mb, seq, dtype=torch.long, device=meta)
    logits = torch.empty(mb, seq, spec.vocab_size, dtype=dtype, device=meta, requires_grad=True)
    return {"input_args": tokens if first else hidden, "output_args": logits if last else hidden}


def _average_grads(model: nn.Module, group: dist.ProcessGroup, size: int) -> None:
    """Average a stage's gradients over its data-parallel replicas, in one flat all-reduce
    after the schedule's last backward. Not DDP: under the schedule's per-micro-batch
    no_sync, DDP's reducer rebuilds its buckets from twice the parameters on the second step
    and fails (torch 2.13)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat /= size
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(synced)


def _replica(mesh: DeviceMesh) -> dist.ProcessGroup:
    """This rank's data-parallel replica (all its stages and tensor-parallel ranks) as a
    group; every rank creates every replica's group, as `new_group` requires."""
    return _my_group([mesh.mesh[:, d].flatten().tolist() for d in range(mesh.size(1))])


def _my_group(groups: list[list[int]]) -> dist.ProcessGroup:
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _first_and_last_stages(mesh: DeviceMesh) -> dist.ProcessGroup:
    """This rank's replica's first and last stage (the same tp rank of each) as a group."""
    firsts, lasts = mesh.mesh[0].flatten().tolist(), mesh.mesh[-1].flatten().tolist()
    return _my_group([list(pair) for pair in zip(firsts, lasts, strict=True)])


def _local_grads(par: Parallel, counted_once: bool = False) -> list[torch.Tensor]:
    """This rank's gradient tensors (the local shard of a DTensor)."""
    return [_local(g) for g in _grads(par, counted_once)]


def _grads(par: Parallel, counted_once: bool) -> list[torch.Tensor]:
    skip = par.norm_excluded if counted_once else set()
    return [p.grad for p in par.grad_params() if p not in skip]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _copies(t: torch.Tensor) -> int:
    """How many ranks hold this rank's shard of `t`: a DTensor is the same on every rank of
    a mesh dimension it is replicated over (tensor parallel: the norms' weights)."""
    if not hasattr(t, "placements"):
        return 1
    mesh = t.device_mesh
    return math.prod(mesh.size(i) for i, p in enumerate(t.placements) if p.is_replicate())


def grad_norm(par: Parallel) -> torch.Tensor:
    """The global L2 norm of all gradients, equal on every rank (fp32, on the host)."""
    grads = [g.detach() for g in _grads(par, counted_once=True)]
    if not par.sharded_grads:
        return _norm([_local(g) for g in grads]).cpu()
    by_copies: dict[int, list[torch.Tensor]] = {}
    for g in grads:
        by_copies.setdefault(_copies(g), []).append(_local(g))
    squares = [_norm(local).pow(2) / copies for copies, local in by_copies.items()]
    sq = sum(squares, torch.zeros(())).to(_collective_device(par))
    dist.all_reduce(sq, group=par.norm_group)
    return sq.sqrt().cpu()


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.get_total_norm(grads).float() if grads else torch.zeros(())


def scale_grads(par: Parallel, factor: float) -> None:
    if factor != 1.0:
        torch._foreach_mul_(_local_grads(par), factor)


def _collective_device(par: Parallel) -> torch.device:
    return next(par.model.parameters()).device
