"""Structured output: completions that are JSON by construction (any object, or one that
matches a JSON schema).

A constrained sequence carries a grammar matcher (llguidance, compiled from the schema when
the request is added). Each step the sampler asks the matchers of the constrained rows which
tokens may come next and sets every other token's logit to -inf before penalties,
temperature and top-k/top-p; rows without a grammar in the same batch are untouched. The
engine advances a matcher by every token it appends, and ends the sequence once the grammar
is complete. Speculative decoding skips constrained sequences: they decode one token a step.
"""

from __future__ import annotations

import json

import llguidance
import numpy as np
import torch

from gpucloud.errors import UserError
from gpucloud.serve.params import StructuredOutputsParams

# One line, spaced as json.dumps spaces it: free whitespace lets a model pad an answer with
# newlines until max_tokens, and costs tokens that say nothing.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarCompiler:
    """Turns StructuredOutputsParams into matchers over one tokenizer's vocabulary."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        """`tokenizer` is a gpucloud.models.tokenizer.Tokenizer; `vocab_size` the model's
        (ids past the tokenizer's own are never allowed)."""
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_token_ids) or None
        )

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the grammar. Raises UserError for a schema the
        library cannot compile (bad JSON, an unsupported keyword), naming the problem."""
        schema = spec.schema()
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        except ValueError as e:
            raise UserError(f"response_format: the JSON schema is not valid JSON: {e}") from None
        problem = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if problem:
            text = schema if isinstance(schema, str) else json.dumps(schema)
            raise UserError(f"response_format: unsupported JSON schema ({problem}): "
                            f"{_shorten(text)}")  # fmt: skip
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise UserError(f"response_format: unsupported JSON schema ({matcher.get_error()})")
        return matcher


def mask_disallowed(logits: torch.Tensor, matchers: list) -> torch.Tensor:
    """`logits` [rows, vocab] with -inf wherever a row's matcher forbids the token; rows whose
    matcher is None keep theirs. Returns `logits` itself when no row is constrained, else a
    masked copy."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    bits = np.stack([np.frombuffer(matchers[i].compute_bitmask(), dtype=np.uint8) for i in rows])
    allowed = np.unpackbits(bits, axis=1, bitorder="little")[:, :vocab].astype(bool)
    index = torch.tensor(rows, device=logits.device)
    banned = torch.from_numpy(~allowed).to(logits.device)
    out = logits.clone()
    out[index] = out[index].masked_fill(banned, float("-inf"))
    return out


def mask_guessed_rows(logits: torch.Tensor, matcher, draft: list[int]) -> torch.Tensor:
    """A constrained sequence's verification logits [len(draft) + 1, vocab], each row masked
    as the sampler would mask it had the guesses before it been decoded: a copy of the
    matcher advances over the guesses. It stops at the first guess the grammar refuses (or
    after one that completes it): that guess cannot match the masked argmax, so no later
    row is ever read."""
    out, state = logits.clone(), matcher.deep_copy()
    for row, token in enumerate([*draft, None]):
        out[row : row + 1] = mask_disallowed(logits[row : row + 1], [state])
        if token is None or advance(state, token):
            break
    return out


def advance(matcher, token: int) -> bool:
    """Feed `token` to `matcher`; True when the grammar is complete after it (the sequence
    has nothing left to say). A token the matcher refuses also ends it: the mask made it
    impossible, so only a library fault gets here."""
    return not matcher.consume_token(token) or matcher.is_stopped()


def _shorten(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
