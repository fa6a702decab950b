"""Does a command's real output match the output a document shows for it?

What may differ: numbers (timings, ids, pids, ports, losses, counts; with their unit, so
"535.4 ms" matches "1.02 s"), API keys (`gpc_...`), hex ids, whitespace and the length of
table rules (rich sizes columns to their content). What may be left out: lines made only of
table borders, and any lines where the shown output has a skip marker:

- a line that is only `...` or `…`, or `... (a comment)`: any number of lines;
- a line that starts with `... `: any lines, then one line that ends with the rest;
- `...` inside a line: any characters.

Everything else (words, punctuation, the order of lines) must be the same.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

UNIT = r"(?: ?(?:ms|s|min|h|days?|B|KiB|MiB|GiB|TiB|K|M|B|%))?"
NUMBER = r"\d+(?:[.,]\d+)*(?:e[+-]?\d+)?"
# Order matters: the first alternative that matches at a position wins.
_VARIABLE = [
    (re.compile(r"gpc_[A-Za-z0-9_-]{6,}"), r"gpc_[A-Za-z0-9_-]+"),
    (re.compile(r"(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{8,}"), r"[0-9a-f]+"),
    (re.compile(NUMBER + UNIT + r"(?![A-Za-z])"), NUMBER + UNIT),
    (re.compile(NUMBER), NUMBER),
]
_RULES = re.compile(r"([━─═])\1+")
_BORDER = re.compile(r"[\s┏┓┗┛┡┩└┘┳┻╇┼┴┬├┤┃│━─═╭╮╰╯]*")
_SPACE = re.compile(r"\s+")
KEY = re.compile(r"gpc_[A-Za-z0-9_-]+")


def normalize(line: str) -> str:
    return _RULES.sub(r"\1", _SPACE.sub(" ", line)).strip()


def is_skip(shown: str) -> bool:
    s = shown.strip()
    return s in ("...", "…") or (s.startswith("... (") and s.endswith(")"))


@cache
def line_pattern(shown: str) -> re.Pattern[str]:
    """The regular expression that a real line must match in full."""
    s = normalize(shown)
    out, i = [], 0
    while i < len(s):
        if s.startswith("...", i):
            out.append(".*")
            i += 3
            continue
        for pattern, replacement in _VARIABLE:
            m = pattern.match(s, i)
            if m and (i == 0 or not s[i - 1].isalnum() or replacement != r"[0-9a-f]+"):
                out.append(replacement)
                i = m.end()
                break
        else:
            out.append(re.escape(s[i]))
            i += 1
    return re.compile("".join(out))


@dataclass(frozen=True)
class Mismatch:
    """Where the alignment got furthest: the shown line it could not match, and the real
    lines around the place it was expected."""

    shown_line: str
    real_near: list[str]

    def __str__(self) -> str:
        near = "\n".join(f"    | {line}" for line in self.real_near) or "    (end of output)"
        return f"shown line not found:\n    > {self.shown_line}\nreal output there:\n{near}"


def match(shown: str, real: str) -> Mismatch | None:
    """None when `real` is an output that `shown` describes, else where they part."""
    want = [line for line in shown.rstrip().splitlines()]
    have = [line for line in real.rstrip().splitlines()]
    best = [0, 0]  # furthest (shown index, real index) reached

    @cache
    def go(i: int, j: int) -> bool:
        if i > best[0]:
            best[:] = [i, j]
        if i == len(want):
            return all(_is_border_or_blank(line) for line in have[j:])
        w = want[i]
        if is_skip(w):
            return any(go(i + 1, k) for k in range(j, len(have) + 1))
        if w.strip().startswith("... "):
            tail = line_pattern("..." + w.strip()[3:])
            return any(tail.fullmatch(normalize(have[k])) and go(i + 1, k + 1)
                       for k in range(j, len(have)))  # fmt: skip
        if j < len(have):
            if line_pattern(w).fullmatch(normalize(have[j])) and go(i + 1, j + 1):
                return True
            if _is_border_or_blank(have[j]) and not _is_border_or_blank(w):
                return go(i, j + 1)
        return False

    if go(0, 0):
        return None
    i, j = best
    return Mismatch(want[min(i, len(want) - 1)], have[max(0, j - 2) : j + 3])


def _is_border_or_blank(line: str) -> bool:
    return _BORDER.fullmatch(line) is not None and "┃" not in line and "│" not in line


def learned_keys(shown: str, real: str) -> dict[str, str]:
    """The API keys that `shown` prints, mapped to the real ones at the same place (the
    shown ones are from another run; later commands that quote them get the real ones)."""
    pairs = zip(KEY.findall(shown), KEY.findall(real), strict=False)
    return {a: b for a, b in pairs if a != b}
