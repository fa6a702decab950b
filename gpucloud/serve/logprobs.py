"""Log-probabilities of chosen tokens, with their rank and the most likely alternatives.

One function for both kinds the engine reports: the sampled token of a step (the sampler)
and each prompt token given the tokens before it (the runner, for prompt logprobs).
"""

from __future__ import annotations

import torch

from gpucloud.serve.sequence import Logprob


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_ns: list[int]):
    """For each row of `logits` [rows, vocab]: the log-probability of `token_ids[row]` under
    the row's softmax, its rank (1 = most likely) and the `top_ns[row]` most likely tokens.
    Returns one `Logprob` per row."""
    # At least fp32: half-precision logits lose whole digits in the log-softmax.
    logprobs = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0]
    ranks = (logprobs > chosen[:, None]).sum(-1) + 1
    k = min(max(top_ns, default=0), logprobs.shape[-1])
    top_lp, top_ids = (t.tolist() for t in logprobs.topk(k, dim=-1))
    ids, lps, rank_list = token_ids.tolist(), chosen.tolist(), ranks.tolist()
    return [
        Logprob(ids[i], lps[i], rank_list[i], dict(zip(top_ids[i][:n], top_lp[i][:n], strict=True)))
        for i, n in enumerate(top_ns)
    ]
