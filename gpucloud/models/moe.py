"""Routing in a mixture-of-experts layer: each token's top-k experts, the load-balancing loss
that keeps the router from sending everything to a few experts, and expert capacity.

Pure tensor functions over the router's probabilities [tokens, experts]; `SparseMoE` in
llama.py runs the experts. Serving only uses `top_k`; training adds the other two.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def top_k(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k most probable experts [tokens, k] and their weights, renormalized to
    sum to 1 over the k (Mixtral's routing)."""
    weights, chosen = probs.topk(k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), chosen


def balance_loss(probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, as transformers' Mixtral computes it:
    E · Σ_e f_e · P_e, with f_e the share of tokens that chose expert e (per choice slot,
    summed over the k slots) and P_e the router's mean probability of e. It is k when the
    router spreads tokens evenly and grows up to k · E as routing collapses onto one expert;
    its gradient reaches the router through P."""
    experts = probs.shape[-1]
    share = F.one_hot(chosen, experts).float().mean(0)  # [k, experts]
    return experts * (share * probs.mean(0)).sum()


def capacity(tokens: int, k: int, experts: int, factor: float) -> int:
    """Assignments one expert takes: `factor` × its even share of tokens · k (at least 1)."""
    return max(1, math.ceil(factor * tokens * k / experts))


def within_capacity(chosen: torch.Tensor, experts: int, factor: float) -> torch.Tensor:
    """Which (token, slot) assignments an expert takes [tokens, k] (bool): each expert serves
    up to `capacity` of them, first choices before second choices and earlier tokens first
    (GShard's order); the overflow is dropped, so the token keeps only its residual path."""
    tokens, k = chosen.shape
    order = chosen.t().reshape(-1)  # slot-major: every token's first choice, then second, ...
    onehot = F.one_hot(order, experts)
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # place in its expert's queue
    keep = position < capacity(tokens, k, experts, factor)
    return keep.view(k, tokens).t()
