"""The CLI's help: every command or flag a help text names exists, and help is never cut."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import typer

from gpucloud.cli.main import _app

GPUCLOUD = str(Path(sys.executable).parent / "gpucloud")
ROOT = typer.main.get_command(_app)
WORD = re.compile(r"[a-z][a-z0-9-]*")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _commands(cmd=ROOT, path=()):
    """Every command and group of the app with its path, the root first."""
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def _help_texts(cmd) -> list[str]:
    texts = [cmd.help, cmd.short_help, cmd.epilog]
    texts += [getattr(p, "help", None) for p in cmd.params]
    return [t for t in texts if t]


def _flags(cmd) -> set[str]:
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}


def _resolve(words: list[str]) -> tuple[object, str | None]:
    """The command that `gpucloud WORDS...` names (its leading lowercase words), or why none."""
    cmd, path = ROOT, ["gpucloud"]
    for word in words:
        subs = getattr(cmd, "commands", None)
        if subs is None or not WORD.fullmatch(word):
            break  # a command's arguments, or prose after a group: the path ends here
        if word not in subs:
            return None, f"`{' '.join(path)}` has no command {word!r}"
        cmd, path = subs[word], [*path, word]
    return cmd, None


def problems_in(text: str, own_flags: set[str]) -> list[str]:
    """What `text` names that does not exist: `gpucloud CMD ...` references (also
    backticked `CMD SUB ...` without the prefix) and their flags, and bare flags, which must
    be the command's own."""
    found = []
    spans = [(m.start(), m.end()) for m in re.finditer(r"`[^`]*`", text)]
    referenced = set()
    starts = [m.start() for m in re.finditer(r"\bgpucloud (?=[a-z])", text)]
    starts += [a + 1 for a, b in spans if text[a + 1 : b - 1].split(" ")[0] in ROOT.commands]
    for start in starts:
        end = next((b - 1 for a, b in spans if a < start < b), None)
        ref = text[start:end] if end is not None else re.split(r"[.,;:()]", text[start:])[0]
        words = ref.split()
        if words[0] == "gpucloud":
            words = words[1:]
        cmd, why = _resolve(words)
        if why:
            found.append(f"{ref.strip()!r}: {why}")
            continue
        if end is not None:  # in backticks: the flags after the command are its own
            referenced.update(range(start, end))
            found += [f"{ref!r}: no flag {f}" for f in FLAG.findall(ref) if f not in _flags(cmd)]
    for m in FLAG.finditer(text):
        if m.start() not in referenced and m.group() not in own_flags:
            found.append(f"{m.group()} is not a flag of this command")
    return found


def test_every_command_and_flag_named_in_help_exists():
    problems = [
        f"gpucloud {' '.join(path)}: {p}"
        for path, cmd in _commands()
        for text in _help_texts(cmd)
        for p in problems_in(text, _flags(cmd))
    ]
    assert problems == []


def test_the_check_catches_names_that_do_not_exist():
    own = {"--json"}
    assert problems_in("Scheduler preset (gpucloud sim list shows them).", own) == [
        "'gpucloud sim list shows them': `gpucloud sim` has no command 'list'"
    ]
    assert problems_in("see `model lst`", own) == [
        "'model lst': `gpucloud model` has no command 'lst'"
    ]
    assert problems_in("run `gpucloud serve DIR --no-such` or --json", own) == [
        "'gpucloud serve DIR --no-such': no flag --no-such"
    ]
    assert problems_in("with --jsn", own) == ["--jsn is not a flag of this command"]
    assert problems_in("`gpucloud sim policies`, `gpucloud train FILE`, --json", own) == []


def _piped(args: list[str]) -> str:
    """Output of the CLI as a pipe sees it, with COLUMNS and LINES unset."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TERMINAL_WIDTH")}
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, check=True)
    return out.stdout


def test_help_is_whole_in_a_pipe():
    # Every command's help, rendered by one process whose output is a pipe.
    script = (
        "import sys, typer; from gpucloud.cli.main import _app, app\n"
        "def walk(c, p):\n"
        "    yield p\n"
        "    for n, s in getattr(c, 'commands', {}).items(): yield from walk(s, [*p, n])\n"
        "for path in walk(typer.main.get_command(_app), []):\n"
        "    print('=== ' + ' '.join(path), flush=True)\n"
        "    sys.argv = ['gpucloud', *path, '--help']\n"
        "    try: app()\n"
        "    except SystemExit: pass\n"
    )
    out = _piped([sys.executable, "-c", script])
    assert out.count("=== ") == len(list(_commands()))
    assert "…" not in out, [line for line in out.splitlines() if "…" in line]
    up = _piped([GPUCLOUD, "up", "--help"])
    assert "--node-memory-gib" in up and "`gpucloud sim policies` shows them" in " ".join(
        line.strip("│ ") for line in up.splitlines()
    )


def test_a_table_wider_than_any_terminal_is_whole_in_a_pipe():
    cell = "word " * 60  # 300 columns in one cell
    script = (
        "from gpucloud.cli.output import console, table\n"
        f"console.print(table('Wide', ['name', 'reason'], [('a-long-name' * 20, {cell!r})]))\n"
    )
    out = _piped([sys.executable, "-c", script])
    assert "…" not in out
    assert "a-long-name" * 20 in out and cell.strip() in out  # one line each, not wrapped
