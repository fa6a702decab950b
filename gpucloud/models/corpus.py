"""Real English text for demos and tokenizer training, built at run time from the docstrings
of the Python standard library installed here, so no text is copied into the repository.

Docstrings are found with a pattern (a triple-quoted string opening a module, or right after
a line ending in `:`) rather than `ast.parse`, which takes ~9 s over the whole library where
the pattern takes well under one. The literal is decoded with `ast.literal_eval` and
dedented like `inspect.cleandoc`, so escapes and indentation come out as `help()` shows them.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# Test suites, GUI demos and vendored packages: code samples more than prose.
_SKIP_DIRS = frozenset(
    {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__",
     "ensurepip", "turtledemo", "tkinter", "__phello__"}
)  # fmt: skip

_DOCSTRING = re.compile(
    r"(?:\A(?:[ \t]*(?:#[^\n]*)?\n)*|:[ \t]*(?:#[^\n]*)?\n)"  # file start, or a block opener
    r"[ \t]*([rRuU]?)(\"\"\"|''')(.*?)\2",
    re.DOTALL,
)


def stdlib_text(max_bytes: int | None = None) -> str:
    """Docstrings of the standard library joined by blank lines, in a fixed file order.

    The same Python installation always gives the same text. `max_bytes` caps the UTF-8 size
    (cut at a docstring boundary, or inside the first one if it alone is larger).
    """
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    parts: list[str] = []
    size = 0
    for doc in _all_docstrings():
        n = len(doc.encode()) + 2
        if max_bytes is not None and size + n > max_bytes:
            if not parts:
                parts.append(doc.encode()[:max_bytes].decode(errors="ignore"))
            break
        parts.append(doc)
        size += n
    return "\n\n".join(parts)


@functools.cache
def _all_docstrings() -> tuple[str, ...]:
    return tuple(doc for path in _source_files() for doc in _docstrings(path.read_bytes()))


def _source_files() -> Iterator[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def _docstrings(source: bytes) -> Iterator[str]:
    text = source.decode("utf-8", errors="replace")
    for match in _DOCSTRING.finditer(text):
        prefix, quote, body = match.groups()
        try:
            value = ast.literal_eval(prefix + quote + body + quote)
        except (SyntaxError, ValueError):
            continue  # e.g. a quote escaped inside the docstring: skip rather than guess
        doc = inspect.cleandoc(value)
        if len(doc) >= 20:  # one-word stubs ("Foo.") teach a tokenizer nothing
            yield doc
