"""The runnable parts of a Markdown document: shell sessions and Python snippets.

A fenced block whose lines start with `$ ` is a shell session: each `$ ` line is a command
(continued over the next lines while it ends with a backslash or has an open quote), and
the lines up to the next command are its output. A ```python block is a snippet: with
`>>>` prompts, each statement's output follows it; otherwise the plain block right after
it, if any, is what it prints. Other blocks (sample figures, config files) are not run.

`<!-- doc-test: skip (REASON) -->` on the line before a block marks it as not run by the
doc test, with the reason shown to readers of the source.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

SKIP = re.compile(r"<!-- doc-test: skip \((?P<reason>[^)]+)\) -->")
FENCE = re.compile(r"^```(?P<lang>\w*)\s*$")


@dataclass
class Command:
    text: str
    output: str
    line: int  # 1-based line of the `$ ` in the document


@dataclass
class Block:
    kind: str  # "shell", "pycon", "python" or "text"
    body: str
    line: int  # 1-based line of the opening fence
    section: str
    skip: str | None = None
    output: str | None = None  # a python block: the text block that follows it
    commands: list[Command] = field(default_factory=list)


def parse(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks: list[Block] = []
    section, i, skip, previous_end = "(top)", 0, None, -2
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        if m := SKIP.search(line):
            skip = m["reason"]
        fence = FENCE.match(line)
        if not fence:
            if line.strip() and not SKIP.search(line):
                skip = None
            i += 1
            continue
        end = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("```"))
        body = lines[i + 1 : end]
        block = Block(_kind(fence["lang"], body), "\n".join(body), i + 1, section, skip)
        if block.kind == "shell":
            block.commands = _commands(body, i + 2)
        previous = blocks[-1] if blocks else None
        if (
            block.kind == "text"
            and previous is not None
            and previous.kind == "python"
            and previous.output is None
            and previous_end == i - 1
        ):
            previous.output = block.body  # the output block right below its snippet
        else:
            blocks.append(block)
        skip, i, previous_end = None, end + 1, end
    return blocks


def _kind(lang: str, body: list[str]) -> str:
    if lang == "python":
        return "pycon" if any(b.startswith(">>> ") for b in body) else "python"
    if lang == "" and any(b.startswith("$ ") for b in body):
        return "shell"
    return "text"


def _commands(body: list[str], first_line: int) -> list[Command]:
    commands: list[Command] = []
    i = 0
    while i < len(body):
        if not body[i].startswith("$ "):
            if not commands:
                raise ValueError(f"line {first_line + i}: output before the first command")
            commands[-1].output += body[i] + "\n"
            i += 1
            continue
        start, text = i, body[i][2:]
        while _continues(text) and i + 1 < len(body):
            i += 1
            text += "\n" + body[i]
        commands.append(Command(text, "", first_line + start))
        i += 1
    return commands


def _continues(text: str) -> bool:
    if text.endswith("\\"):
        return True
    try:
        shlex.split(text, comments=True)
    except ValueError:  # an open quote: the command goes on
        return True
    return False
