"""Task files: JSONL in the shapes lm-evaluation-harness uses, one item a line.

The first line's keys pick the kind, and every line must have the same shape:
- multiple choice `{"context": str, "choices": [str, ...], "answer": int}`: each choice is
  appended to the context as written (put the leading space in the choice);
- perplexity `{"text": str}`: one document a line, scored whole; in process, one longer
  than the model's context in rolling windows as lm-eval does (windows.py); through an
  endpoint, whose tokens are not known here, it must fit the server's context;
- generation `{"prompt": str, "answer": str}` and optionally `"stop": [str, ...]` (default
  a blank line) and `"max_tokens": int` (default 32): greedy, exact match.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from gpucloud.errors import UserError

DEFAULT_STOP = ("\n\n",)
DEFAULT_MAX_TOKENS = 32


class TaskKind(StrEnum):
    MULTIPLE_CHOICE = "multiple_choice"
    PERPLEXITY = "perplexity"
    GENERATION = "generation"


# The keys each kind must have, and the optional ones it may have.
_SHAPES: dict[TaskKind, tuple[set[str], set[str]]] = {
    TaskKind.MULTIPLE_CHOICE: ({"context", "choices", "answer"}, set()),
    TaskKind.PERPLEXITY: ({"text"}, set()),
    TaskKind.GENERATION: ({"prompt", "answer"}, {"stop", "max_tokens"}),
}


@dataclass(frozen=True, slots=True)
class ChoiceItem:
    context: str
    choices: tuple[str, ...]
    answer: int


@dataclass(frozen=True, slots=True)
class TextItem:
    text: str


@dataclass(frozen=True, slots=True)
class GenerationItem:
    prompt: str
    answer: str
    stop: tuple[str, ...] = DEFAULT_STOP
    max_tokens: int = DEFAULT_MAX_TOKENS


Item = ChoiceItem | TextItem | GenerationItem


@dataclass(frozen=True, slots=True)
class Task:
    name: str  # the file's stem
    kind: TaskKind
    items: tuple[Item, ...]
    hash: str  # "sha256:<hex>" of the file's bytes: results name exactly what was measured


def load_task(path: str | Path) -> Task:
    """Read and check a task file. Raises UserError naming the file, the line and the field
    that is wrong, and what is allowed."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read task file {path}: {e.strerror}") from None
    rows = [(n, line) for n, line in enumerate(data.decode("utf-8").splitlines(), 1)]
    rows = [(n, _parse_line(path, n, line)) for n, line in rows if line.strip()]
    if not rows:
        raise UserError(f"{path}: no items (one JSON object a line)")
    kind = _kind_of(path, *rows[0])
    items = tuple(_item(kind, path, n, obj) for n, obj in rows)
    return Task(path.stem, kind, items, "sha256:" + hashlib.sha256(data).hexdigest())


def _parse_line(path: Path, n: int, line: str) -> dict:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{n}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path}:{n}: each line must be a JSON object")
    return obj


def _kind_of(path: Path, n: int, obj: dict) -> TaskKind:
    for kind, (required, optional) in _SHAPES.items():
        if required <= obj.keys() <= required | optional:
            return kind
    shapes = "; ".join(", ".join(sorted(req)) for req, _ in _SHAPES.values())
    raise UserError(f"{path}:{n}: keys {sorted(obj)} match no task shape (one of: {shapes})")


def _item(kind: TaskKind, path: Path, n: int, obj: dict) -> Item:
    required, optional = _SHAPES[kind]
    if not required <= obj.keys() <= required | optional:
        raise UserError(
            f"{path}:{n}: keys {sorted(obj)}, but this {kind} task's lines have "
            f"{sorted(required)}" + (f" and optionally {sorted(optional)}" if optional else "")
        )
    where = f"{path}:{n}"
    if kind is TaskKind.MULTIPLE_CHOICE:
        return _choice_item(where, obj)
    if kind is TaskKind.PERPLEXITY:
        return TextItem(_text(where, obj, "text"))
    return _generation_item(where, obj)


def _choice_item(where: str, obj: dict) -> ChoiceItem:
    choices = obj["choices"]
    if not (isinstance(choices, list) and len(choices) >= 2):
        raise UserError(f"{where}: choices must be a list of at least 2 strings")
    if not all(isinstance(c, str) and c for c in choices):
        raise UserError(f"{where}: every choice must be a non-empty string")
    answer = obj["answer"]
    if type(answer) is not int or not 0 <= answer < len(choices):
        raise UserError(f"{where}: answer must be an index in [0, {len(choices) - 1}]")
    return ChoiceItem(_text(where, obj, "context"), tuple(choices), answer)


def _generation_item(where: str, obj: dict) -> GenerationItem:
    stop = obj.get("stop", list(DEFAULT_STOP))
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise UserError(f"{where}: stop must be a list of non-empty strings")
    max_tokens = obj.get("max_tokens", DEFAULT_MAX_TOKENS)
    if type(max_tokens) is not int or max_tokens < 1:
        raise UserError(f"{where}: max_tokens must be an integer >= 1")
    answer = obj["answer"]
    if not isinstance(answer, str):
        raise UserError(f"{where}: answer must be a string")
    return GenerationItem(_text(where, obj, "prompt"), answer, tuple(stop), max_tokens)


def _text(where: str, obj: dict, key: str) -> str:
    value = obj[key]
    if not (isinstance(value, str) and value.strip()):
        raise UserError(f"{where}: {key} must be a non-empty string")
    return value
