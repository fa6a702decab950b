"""Reading a job or deployment spec file (YAML, or TOML by its suffix) into its schema.

Every problem comes back as one line that says where it is and what is allowed: a syntax
error as FILE:LINE:COLUMN, a bad value as the key, what the key accepts and what it got
("command: expected a string or a list of strings, got true").
"""

from __future__ import annotations

import difflib
import json
import re
import tomllib
import types
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from gpucloud.errors import ConfigError, GpucloudError

M = TypeVar("M", bound=BaseModel)


def load(path: str | Path, model: type[M], overrides: dict[str, Any] | None = None) -> M:
    """Parse and validate `path`, with the keys of `overrides` that are not None (command
    line flags) in place of the file's. Raises ConfigError naming the file and each bad
    key."""
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {p}: {e}") from None
    data = _parse(p, text)
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a mapping of keys (name, command, gpus, ...)")
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{p}: {explain(e, model)}") from None
    except GpucloudError as e:  # e.g. an unknown GPU type, with its "did you mean"
        raise ConfigError(f"{p}: {e}") from None


def _parse(p: Path, text: str) -> Any:
    if p.suffix == ".toml":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            # Python 3.11's message ends with "(at line L, column C)"
            m = re.fullmatch(r"(.*) \(at line (\d+), column (\d+)\)", str(e))
            where, what = (f"{m[2]}:{m[3]}", m[1]) if m else ("", str(e))
            raise ConfigError(f"{p}:{where}: {what}" if where else f"{p}: {what}") from None
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        what = e.problem or e.context or "invalid YAML"
        if e.context and e.context_mark and e.problem:
            what += f" ({e.context} at {e.context_mark.line + 1}:{e.context_mark.column + 1})"
        raise ConfigError(f"{where}: {what}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: {' '.join(str(e).split())}") from None


# --- validation errors, one line ------------------------------------------------------


def explain(error: ValidationError, model: type[BaseModel]) -> str:
    """One line for every problem in `error`: "key: expected ..., got ..." for a value of
    the wrong type, the schema's own message otherwise; joined with "; "."""
    found = [(_field_path(model, e["loc"]), e) for e in error.errors()]
    lines: list[str] = []
    for path, e in found:
        if _is_type_error(e) and any(
            other is not e
            and other_path[: len(path)] == path
            and (len(other_path) > len(path) or not _is_type_error(other))
            for other_path, other in found
        ):
            continue  # a union's other branch took the value and found the real problem
        line = _one(model, path, e)
        if line not in lines:
            lines.append(line)
    return "; ".join(lines)


def _is_type_error(e: dict) -> bool:
    return e["type"].endswith(("_type", "_parsing")) or e["type"] in (
        "int_from_float",
        "literal_error",
    )


def _one(model: type[BaseModel], path: tuple, e: dict) -> str:
    where = _render_path(path)
    if path[-1:] == ("[key]",):  # (..., KEY, '[key]'): the key itself is wrong
        where = f"{_render_path(path[:-2])}: key {_shown(path[-2])}".lstrip(": ")
    if e["type"] == "extra_forbidden":
        keys = list(_model_at(model, path[:-1]).model_fields)
        close = difflib.get_close_matches(str(path[-1]), keys, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"allowed: {', '.join(keys)}"
        return f"{where}: unknown key; {hint}"
    if e["type"] == "missing":
        return f"{where}: required"
    if _is_type_error(e):
        expected = _expected(_annotation_at(model, path))
        return f"{where}: expected {expected}, got {_shown(e['input'])}"
    msg = e["msg"].removeprefix("Value error, ")
    msg = msg[:1].lower() + msg[1:]
    if e["type"] == "value_error" or path[-1:] in ((), ("[key]",)):
        return f"{where}: {msg}" if where else msg
    return f"{where}: {msg}, got {_shown(e['input'])}"


def _field_path(model: type[BaseModel], loc: tuple) -> tuple:
    """`loc` without pydantic's union-branch tags ('command', 'list[str]', 0) -> ('command', 0)."""
    path: list = []
    ann: Any = model
    for part in loc:
        ann = _unwrap(ann)
        if _is_union(ann) and len(_members(ann)) > 1 and isinstance(part, str):
            ann = _branch(ann, part)  # a tag: pydantic tags only unions of several types
            continue
        path.append(part)
        ann = _child(ann, part)
    return tuple(path)


def _annotation_at(model: type[BaseModel], path: tuple) -> Any:
    ann: Any = model
    for i, part in enumerate(path):
        if part != "[key]":  # (..., KEY, '[key]') is a mapping's key itself
            ann = _child(ann, "[key]" if path[i + 1 : i + 2] == ("[key]",) else part)
    return ann


def _model_at(model: type[BaseModel], path: tuple) -> type[BaseModel]:
    ann = _unwrap(_annotation_at(model, path))
    members = get_args(ann) if _is_union(ann) else (ann,)
    return next(m for m in members if isinstance(m, type) and issubclass(m, BaseModel))


def _child(ann: Any, part: Any) -> Any:
    """The annotation of `part` (a key, an index) inside a value annotated `ann`."""
    ann = _unwrap(ann)
    if _is_union(ann):  # the branch that has children (a model, a list, a mapping)
        ann = next((a for a in get_args(ann) if get_origin(_unwrap(a)) or _is_model(a)), Any)
        ann = _unwrap(ann)
    if _is_model(ann):
        field = ann.model_fields.get(part)
        return field.annotation if field is not None else Any
    args = get_args(ann)
    if get_origin(ann) is list and args:
        return args[0]
    if get_origin(ann) is dict and len(args) == 2:
        return args[0] if part == "[key]" else args[1]
    return Any


def _branch(union: Any, tag: str) -> Any:
    """The member of `union` that pydantic tags `tag` (e.g. 'list[str]', 'constrained-str')."""
    for member in get_args(union):
        m = _unwrap(member)
        name = getattr(get_origin(m) or m, "__name__", "")
        if name and (tag == name or tag.startswith(f"{name}[") or tag.endswith(f"-{name}")):
            return member
    return Any


def _expected(ann: Any) -> str:
    """What a value annotated `ann` may be, in words ("a string or a list of strings")."""
    ann = _unwrap(ann)
    args = get_args(ann)
    if _is_union(ann):
        return " or ".join(_expected(a) for a in _members(ann))
    if get_origin(ann) is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if get_origin(ann) is list and args:
        return f"a list of {_plural(args[0])}"
    if get_origin(ann) is dict and len(args) == 2:
        return f"a mapping of {_plural(args[0])} to {_plural(args[1])}"
    if _is_model(ann):
        return f"a mapping with keys {', '.join(ann.model_fields)}"
    return _NOUNS.get(ann, ("a valid value", ""))[0]


_NOUNS = {
    str: ("a string", "strings"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    bool: ("true or false", "booleans"),
}


def _plural(ann: Any) -> str:
    ann = _unwrap(ann)
    return _NOUNS[ann][1] if ann in _NOUNS else _expected(ann)


def _shown(value: Any) -> str:
    """A value as the spec file wrote it: true, null, 3, "text", a list, a mapping."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _render_path(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def _unwrap(ann: Any) -> Any:
    while get_origin(ann) is Annotated:
        ann = get_args(ann)[0]
    return ann


def _members(union: Any) -> list[Any]:
    return [a for a in get_args(union) if a is not type(None)]


def _is_union(ann: Any) -> bool:
    return get_origin(ann) in (Union, types.UnionType)


def _is_model(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, BaseModel)
