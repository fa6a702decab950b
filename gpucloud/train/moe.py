"""Training a mixture-of-experts model: the load-balancing loss of the forward's routing is
added to the loss (weighted by `moe.aux_loss_coef`), expert capacity is set from the config,
and each logged step gets `aux_loss` (unweighted, the mean over micro-batches since the last
logged step) and `dropped_tokens` (the share of routing assignments past capacity), both
from rank 0's micro-batches.

The loss is transformers' Mixtral `aux_loss`: one balance loss over every layer's tokens
together (not a mean of per-layer losses), so the same weights give the same number.

The pipeline does not carry the extra loss between stages, so MoE models train with DDP or
FSDP (`launcher.preflight` says so).
"""

from __future__ import annotations

import torch

from gpucloud.models.llama import LlamaForCausalLM, SparseMoE
from gpucloud.models.moe import balance_loss
from gpucloud.train.config import MoeConfig


class MoeTraining:
    def __init__(self, cfg: MoeConfig | None, model: LlamaForCausalLM):
        self.layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
        cfg = cfg or MoeConfig()
        self.coef = cfg.aux_loss_coef
        for layer in self.layers:
            layer.capacity_factor = cfg.capacity_factor
        self._aux: list[torch.Tensor] = []
        self._dropped: list[torch.Tensor] = []

    def penalty(self) -> torch.Tensor | float:
        """coef × the load-balancing loss of the forward just run (0.0 without MoE)."""
        if not self.layers:
            return 0.0
        aux = self.aux_loss()
        self._aux.append(aux.detach())
        self._dropped.append(torch.stack([m.dropped for m in self.layers]).mean())
        return self.coef * aux

    def aux_loss(self) -> torch.Tensor:
        """The balance loss over the routing of every layer in the last training forward."""
        probs, chosen = zip(*(m.routing for m in self.layers), strict=True)
        return balance_loss(torch.cat(probs), torch.cat(chosen))

    def stats(self) -> dict[str, float]:
        """The step's `aux_loss` and `dropped_tokens` (empty without MoE); starts over."""
        if not self._aux:
            return {}
        out = {"aux_loss": torch.stack(self._aux).mean().item(),
               "dropped_tokens": torch.stack(self._dropped).mean().item()}  # fmt: skip
        self._aux.clear()
        self._dropped.clear()
        return out
