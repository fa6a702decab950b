"""Chat-formatted JSONL for fine-tuning: render with the model's chat template, mark the
tokens to train on, and lay conversations out in fixed-length rows.

A conversation is rendered with the chat template of the model directory's tokenizer
(tokenizer_config.json or chat_template.jinja; gpucloud's own template when it has none).
Only assistant turns are trained on: each one's text, from the end of the generation prompt
that precedes it (`add_generation_prompt=True` of the messages before it) to the end of the
turn (which includes the template's end-of-turn token, so the model learns to stop). The
pieces are tokenized one by one, so a prompt is cut into tokens exactly as at inference.

Rows are `seq_len` tokens. Without packing a row holds one conversation, padded. With
packing a row holds as many consecutive conversations (in a seeded order) as fit; each
keeps its own positions from 0 and a document number, so attention never crosses from one
conversation into another (`document_attention`). A conversation longer than a row is cut.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpucloud.errors import ConfigError
from gpucloud.models.tokenizer import CHAT_TEMPLATE, Tokenizer, load_tokenizer
from gpucloud.train.data import seeded_index

log = logging.getLogger(__name__)

IGNORE = -100  # a target the loss skips (cross_entropy's ignore_index)
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Encoded:
    """A conversation's token ids, and for each whether predicting it is trained on."""

    ids: list[int]
    trained: list[bool]


def chat_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The model's tokenizer, with gpucloud's chat template when the directory has none."""
    tok = load_tokenizer(model_dir)
    if tok.chat_template is None:
        log.warning("%s has no chat_template: using gpucloud's (<|role|>\\n text <|eos|>)",
                    model_dir)  # fmt: skip
        tok.chat_template = CHAT_TEMPLATE
    return tok


def encode_chat(tok: Tokenizer, messages: list[dict], trained_from: int = 0) -> Encoded:
    """Tokens of `messages`, trained on the assistant turns at index >= `trained_from`.

    Raises ConfigError when the template rejects the messages or renders a conversation
    differently from its beginnings (then assistant turns cannot be located).
    """
    full = tok.apply_chat_template(messages, add_generation_prompt=False)
    cuts, trained = [0], [False]
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < trained_from:
            continue
        start = len(_prefix(tok, full, messages[:i], True))
        end = len(_prefix(tok, full, messages[: i + 1], False))
        cuts += [start, end]
        trained += [True, False]
    ids: list[int] = []
    labels: list[bool] = []
    for (a, b), learn in zip(zip(cuts, [*cuts[1:], len(full)], strict=True), trained,
                             strict=True):  # fmt: skip
        piece = tok.backend.encode(full[a:b], add_special_tokens=False).ids
        ids += piece
        labels += [learn] * len(piece)
    if tok.bos_id is not None and ids[:1] != [tok.bos_id]:
        ids, labels = [tok.bos_id, *ids], [False, *labels]
    return Encoded(ids, labels)


def _prefix(tok: Tokenizer, full: str, messages: list[dict], generation: bool) -> str:
    text = tok.apply_chat_template(messages, add_generation_prompt=generation)
    if not full.startswith(text):
        raise ConfigError(
            "the chat template renders a conversation differently from its beginning, so "
            "assistant turns cannot be located: use a template that appends turns"
        )
    return text


# ---- JSONL ----------------------------------------------------------------------------------
def read_jsonl(path: str | Path, parse: Callable[[dict, str], Any]) -> list[Any]:
    """`parse(obj, where)` of every non-blank line. Raises ConfigError naming file:line."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{where}: not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{where}: a line is a JSON object")
        items.append(parse(obj, where))
    if not items:
        raise ConfigError(f"{path} holds no examples")
    return items


def messages_of(value: Any, where: str, key: str = "messages") -> list[dict]:
    """A checked list of {"role", "content"} messages. Raises ConfigError."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f'{where}: "{key}" must be a non-empty list of {{"role", "content"}}')
    for m in value:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(
            m.get("content"), str
        ):  # fmt: skip
            raise ConfigError(f"{where}: each of {key!r} is {{\"role\": one of "
                              f"{', '.join(ROLES)}, \"content\": str}}, got {m!r}")  # fmt: skip
    return [{"role": m["role"], "content": m["content"]} for m in value]


def read_conversations(path: str | Path, tok: Tokenizer) -> list[Encoded]:
    """Encoded conversations of a `{"messages": [...]}` JSONL file. Raises ConfigError."""

    def parse(obj: dict, where: str) -> Encoded:
        messages = messages_of(obj.get("messages"), where)
        if not any(m["role"] == "assistant" for m in messages):
            raise ConfigError(f"{where}: no assistant message to learn from")
        return encode_at(tok, messages, 0, where)

    return read_jsonl(path, parse)


def encode_at(tok: Tokenizer, messages: list[dict], trained_from: int, where: str) -> Encoded:
    """`encode_chat`, its ConfigError prefixed with where the messages come from (file:line)."""
    try:
        return encode_chat(tok, messages, trained_from)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


# ---- rows -----------------------------------------------------------------------------------
def piece(encoded: Encoded, seq_len: int, where: str) -> dict[str, np.ndarray]:
    """Inputs, targets (IGNORE where not trained) and positions of one conversation, cut to
    `seq_len`. Raises ConfigError when no trained token is left."""
    ids = np.asarray(encoded.ids, dtype=np.int64)
    targets = np.where(encoded.trained[1:], ids[1:], IGNORE)[:seq_len]
    if not (targets != IGNORE).any():
        raise ConfigError(f"{where}: no assistant token within data.seq_len = {seq_len} tokens; "
                          "raise data.seq_len")  # fmt: skip
    return {"inputs": ids[:-1][:seq_len], "targets": targets,
            "positions": np.arange(len(targets), dtype=np.int64)}  # fmt: skip


def pack_rows(
    pieces: list[dict[str, np.ndarray]], seq_len: int, pad_id: int, packing: bool, seed: int
) -> dict[str, np.ndarray]:
    """[rows, seq_len] arrays inputs, targets, positions, documents. With `packing`, pieces
    in a seeded order fill each row while they fit; else one piece per row. Padding: pad_id
    inputs, IGNORE targets, document -1."""
    order = np.random.Generator(np.random.PCG64([seed, 2**31])).permutation(len(pieces))
    rows: list[list[dict[str, np.ndarray]]] = []
    used = seq_len
    for i in order if packing else range(len(pieces)):
        size = len(pieces[i]["inputs"])
        if not packing or used + size > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(pieces[i])
        used += size
    return _stack([_row(row, seq_len, pad_id) for row in rows])


def _row(parts: list[dict[str, np.ndarray]], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    fill = seq_len - sum(len(p["inputs"]) for p in parts)
    pad = {"inputs": pad_id, "targets": IGNORE, "positions": 0}
    row = {k: np.concatenate([*(p[k] for p in parts), np.full(fill, v, np.int64)])
           for k, v in pad.items()}  # fmt: skip
    docs = [np.full(len(p["inputs"]), d, np.int64) for d, p in enumerate(parts)]
    row["documents"] = np.concatenate([*docs, np.full(fill, -1, np.int64)])
    return row


def _stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


class Rows:
    """Fixed rows read in a seeded order per epoch: sample g is row seeded_index(g), so a
    resumed run reads exactly what it would have read (as `TokenWindows`)."""

    def __init__(self, arrays: dict[str, np.ndarray], seed: int):
        self.arrays, self.seed = arrays, seed
        self.count = len(next(iter(arrays.values())))

    def batch(self, first_sample: int, count: int) -> dict[str, torch.Tensor]:
        """Each array's rows of samples first_sample ... + count - 1, as tensors."""
        index = [seeded_index(first_sample + k, self.count, self.seed) for k in range(count)]
        return {k: torch.from_numpy(v[index]) for k, v in self.arrays.items()}
