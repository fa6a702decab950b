"""Run a task's items through a backend: one record of per-item numbers each, from which
every metric of the task is computed (metrics.py). The rules follow lm-evaluation-harness,
so scores compare with published ones:
- multiple choice: a choice's loglikelihood is the sum of its tokens' logprobs after the
  context; whitespace ending the context moves to the start of the choice (tokenizers fold a
  leading space into the next word); the context's tokens are those of the context alone.
- perplexity: a text's loglikelihood is the sum over its tokens, the first given bos, one
  longer than the model's context in rolling windows (windows.py); words are runs between
  whitespace, bytes are UTF-8 bytes.
- generation: exact match of the greedy completion, whitespace at both ends ignored.
"""

from __future__ import annotations

import math
import re

from gpucloud.errors import UserError
from gpucloud.eval.backend import Backend
from gpucloud.eval.tasks import ChoiceItem, Task, TaskKind

Record = dict[str, float | str | list[float]]


def score_task(task: Task, backend: Backend, stride: int | None = None) -> list[Record]:
    """One record per item, in the task's order; perplexity texts in windows `stride` tokens
    apart (windows.py)."""
    if task.kind is TaskKind.MULTIPLE_CHOICE:
        return _multiple_choice(task.items, backend)
    if task.kind is TaskKind.PERPLEXITY:
        return _perplexity(task.items, backend, stride)
    return _generation(task.items, backend)


def split_pair(context: str, continuation: str) -> tuple[str, str]:
    """Move the whitespace that ends `context` to the start of `continuation`."""
    stripped = context.rstrip()
    return stripped, context[len(stripped) :] + continuation


def _multiple_choice(items: tuple[ChoiceItem, ...], backend: Backend) -> list[Record]:
    pairs = [[split_pair(item.context, c) for c in item.choices] for item in items]
    prompts = sorted({p for row in pairs for ctx, cont in row for p in (ctx, ctx + cont)})
    scores = dict(zip(prompts, backend.prompt_logprobs(prompts), strict=True))
    records = []
    for item, row in zip(items, pairs, strict=True):
        lls = [_continuation_loglikelihood(scores[ctx], scores[ctx + cont]) for ctx, cont in row]
        norm = [ll / len(c) for ll, c in zip(lls, item.choices, strict=True)]
        records.append({
            "acc": float(_argmax(lls) == item.answer),
            "acc_norm": float(_argmax(norm) == item.answer),
            "loglikelihoods": lls,
        })  # fmt: skip
    return records


def _continuation_loglikelihood(context: list, whole: list) -> float:
    if len(whole) <= len(context):
        raise UserError("a choice adds no token to its context: choices must be non-empty text")
    return math.fsum(whole[len(context) :])


def _perplexity(items, backend: Backend, stride: int | None) -> list[Record]:
    scores = backend.text_logprobs([item.text for item in items], stride)
    return [
        {
            "loglikelihood": math.fsum(lp for lp in lps if lp is not None),
            "words": float(len(re.split(r"\s+", item.text))),
            "bytes": float(len(item.text.encode("utf-8"))),
        }
        for item, lps in zip(items, scores, strict=True)
    ]


def _generation(items, backend: Backend) -> list[Record]:
    outputs = backend.generate(items)
    return [
        {"exact_match": float(out.strip() == item.answer.strip()), "output": out}
        for item, out in zip(items, outputs, strict=True)
    ]


def _argmax(values: list[float]) -> int:
    """The first index of the largest value (ties go to the earlier choice)."""
    return max(range(len(values)), key=values.__getitem__)
