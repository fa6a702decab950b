"""Expert parallelism: a mixture-of-experts model's experts sharded over `ep` ranks of the
data-parallel group (`[parallel] ep`), everything else replicated as before.

The data-parallel ranks form groups of `ep` neighbours (an *expert group*); rank i of a
group holds experts [i·E/ep, (i+1)·E/ep) of every MoE layer. In each layer a rank routes its
own tokens as without sharding (top-k, then capacity over its own tokens, per expert), sends
each kept assignment to the rank holding its expert with one all-to-all (split sizes per
rank), runs its experts on what it received, and sends the outputs back with a second
all-to-all; the autograd of those exchanges carries the gradients the same way back.

An expert's gradient is then the sum over its expert group's tokens. The ranks at the same
place of every expert group (the *replicas*, data-parallel size / ep of them) hold the same
experts: their gradients are summed over the replicas and divided by the data-parallel size,
which is the average DDP or FSDP2 takes of every other gradient. Under DDP the experts are
left out of DDP's all-reduce and reduced here after backward (with ep equal to the
data-parallel size there is no replica and nothing to reduce), and the gradient norm counts
each expert once: the squares of a rank's expert gradients are summed over its expert group.
Under FSDP2 each expert is its own `fully_shard` unit over its replicas (FSDP2 averages it
over them; this module divides by ep) and its gradient a shard the norm already counts once.

Experts keep their global index in their names (`experts` becomes a ModuleDict keyed by it),
so checkpoints hold every expert once under its Hugging Face name and load under any ep.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gpucloud.models.llama import Expert, LlamaForCausalLM, SparseMoE
from gpucloud.train import parallel
from gpucloud.train.config import Layout, RunConfig


class ExpertShards:
    """This rank's experts of every MoE layer and the groups their gradients need."""

    def __init__(self, model: LlamaForCausalLM, cfg: RunConfig, lay: Layout):
        ep, dp = lay.ep, lay.dp
        # Expert groups are neighbouring ranks; replicas are every ep-th rank.
        self.ep_group = parallel._my_group([list(range(g, g + ep)) for g in range(0, dp, ep)])
        self.replica_group = parallel._my_group([list(range(i, dp, ep)) for i in range(ep)])
        self.ep, self.dp = ep, dp
        layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
        per_rank = layers[0].num_experts // ep
        first = dist.get_rank() % ep * per_rank
        owned = range(first, first + per_rank)
        for layer in layers:
            layer.experts = nn.ModuleDict({str(e): layer.experts[e] for e in owned})
            layer.expert_parallel = _Exchange(layer.experts, ep, self.ep_group)
        self.held = nn.ModuleList(layer.experts for layer in layers)
        """Only to iterate over this rank's expert parameters."""
        self.params = set(self.held.parameters())
        self.fsdp = cfg.parallel.strategy == "fsdp"
        if self.fsdp:
            self._fully_shard(cfg, model)
        else:
            names = [name for name, p in model.named_parameters() if p in self.params]
            DDP._set_params_and_buffers_to_ignore_for_model(model, names)

    def _fully_shard(self, cfg: RunConfig, model: LlamaForCausalLM) -> None:
        """Each expert an FSDP2 unit over its replicas (before `parallel` shards the layers
        around them over every rank)."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        device = next(model.parameters()).device.type
        replicas = DeviceMesh.from_group(self.replica_group, device)
        policies = parallel.fsdp_policies(cfg, model)
        for expert in self.held.modules():
            if isinstance(expert, Expert):
                fully_shard(expert, mesh=replicas, **policies)

    def attach(self, par: parallel.Parallel) -> None:
        """Make `par` reduce the expert gradients after backward and, under DDP, count them
        in the norm (FSDP2's shards are counted already). Frozen experts (LoRA trains only
        its adapters) have no gradient to reduce or count."""
        if not any(p.requires_grad for p in self.params):
            return
        reduce_others = par.after_backward

        def after_backward() -> None:
            reduce_others()
            self.reduce_grads()

        par.after_backward = after_backward
        if not self.fsdp:
            par.norm_excluded |= self.params
            par.experts = self

    def reduce_grads(self) -> None:
        """Each expert's gradient, summed over the ranks that fed it tokens, becomes the
        data-parallel mean (what DDP makes of every other gradient)."""
        replicas = self.dp // self.ep
        if replicas > 1 and not self.fsdp:  # the mean over replicas of sums over ep ranks'...
            parallel._average_grads(self.held, self.replica_group, replicas)
        grads = [parallel._local(p.grad) for p in self.held.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, 1 / self.ep)  # ...tokens is ep × the mean over dp ranks

    def with_expert_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The global norm from `norm` (every other gradient's) and the experts': each
        expert's squares counted once, summed over the expert group."""
        grads = [p.grad.detach() for p in self.held.parameters() if p.grad is not None]
        squares = parallel._norm(grads).pow(2).to(norm.device)
        dist.all_reduce(squares, group=self.ep_group)
        return (norm.pow(2) + squares).sqrt()


class _Exchange:
    """A layer's routed tokens run on the ranks that hold their experts (`RunExperts`)."""

    def __init__(self, experts: nn.ModuleDict, ep: int, group: dist.ProcessGroup):
        self.experts, self.ep, self.group = experts, ep, group

    def __call__(self, x, weights, chosen, taken) -> torch.Tensor:
        per_rank = len(self.experts)
        tokens, slot = taken.nonzero(as_tuple=True)
        expert = chosen[tokens, slot]
        order = expert.argsort(stable=True)  # by expert, then token: each rank's share is a run
        tokens, slot, expert = tokens[order], slot[order], expert[order]
        sent = torch.bincount(expert, minlength=per_rank * self.ep)
        received = torch.empty_like(sent)  # [source rank, my expert]: assignments it sends
        dist.all_to_all_single(received, sent, group=self.group)
        send_sizes = sent.view(self.ep, per_rank).sum(1).tolist()
        recv_sizes = received.view(self.ep, per_rank).sum(1).tolist()
        rows = self._all_to_all(x[tokens], recv_sizes, send_sizes)
        mine = torch.arange(per_rank, device=x.device).repeat(self.ep)
        which = mine.repeat_interleave(received)  # each received row's expert, 0..per_rank
        y = torch.zeros_like(rows)
        # Every expert runs, idle ones on no rows, so each has a gradient to reduce.
        for i, module in enumerate(self.experts.values()):
            rows_i = (which == i).nonzero().squeeze(1)
            y.index_add_(0, rows_i, module(rows[rows_i]).to(y.dtype))
        back = self._all_to_all(y, send_sizes, recv_sizes)
        out = torch.zeros_like(x)
        out.index_add_(0, tokens, (back * weights[tokens, slot, None]).to(out.dtype))
        return out

    def _all_to_all(self, t: torch.Tensor, out_sizes: list[int], in_sizes: list[int]):
        return _AllToAll.apply(t, out_sizes, in_sizes, self.group)


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with split sizes whose backward sends the gradients back the way
    the rows came."""

    @staticmethod
    def forward(ctx, t, out_sizes, in_sizes, group):
        ctx.sizes, ctx.group = (out_sizes, in_sizes), group
        out = t.new_empty(sum(out_sizes), t.shape[-1])
        dist.all_to_all_single(out, t.contiguous(), out_sizes, in_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_sizes, in_sizes = ctx.sizes
        return _AllToAll.apply(grad, in_sizes, out_sizes, ctx.group), None, None, None
