"""How every command prints: a rich table for people, `--json` for scripts, one-line errors."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON (bytes, seconds, dollars).")]

# In a terminal rich fits tables to its width. A pipe or a CI log has no width: lines are as
# long as their content (rich would assume 80 columns), so no table is wrapped or cut, and
# no message is broken inside a path.
UNLIMITED = 1_000_000
console = Console(width=None if sys.stdout.isatty() else UNLIMITED)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else UNLIMITED)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    for i, col in enumerate(columns):
        t.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*(str(c) for c in row))
    return t


def emit(data: Any, as_json: bool, render: Callable[[Any], None]) -> None:
    """Print `data` as JSON, or hand it to `render` for the human view."""
    if as_json:
        print_json(data)
    else:
        render(data)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1:
        return f"{s * 1000:.1f} ms"
    if s < 120:
        return f"{s:.2f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def human_count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"
