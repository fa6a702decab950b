"""The doc tier: README.md's commands and Python snippets run, and print what it shows.

The whole README runs in order in one scratch directory that looks like a clone (its
examples, Makefile and .venv are links to this checkout), as a reader who follows the tour
from the top would run it: the model made under "Models" is the one served later, the data
prepared for the control plane's job is the one trained on under "Training".

- `$ CMD` runs with this checkout's .venv/bin first on PATH and GPUCLOUD_HOME in the scratch
  directory; `/tmp/...` paths in commands point into the scratch directory too. It must exit
  0, or, when its shown output is an `error: ...` line, fail (with the code that a trailing
  `(exit code N)` names). Its output (stdout; stdout and stderr when it fails) is compared
  with the shown lines by `output_match` unless none are shown.
- `export NAME=VALUE` sets NAME for the commands after it.
- Servers (`gpucloud serve|up|server`, `make run`) start in the background on a free port
  that replaces the README's port in every later command and snippet; the test goes on
  once their shown lines have appeared. `kill -SIG $(pgrep -f 'CMD')` signals the server
  this test started with CMD (never anything found by name) and compares what it prints
  until it exits, with exit code 0.
- Commands that only read (`list`, `get`, `logs`, `usage`, `cat`, `grep`, ...) are retried
  until their output matches, for what the control plane does in the background.
- Blocks marked `<!-- doc-test: skip (REASON) -->` are not run; the reasons may only be
  benchmarks, test runs and the server on the fixed default port (test_skips_are_few).

At the end every process that carries this run's marker in its environment (servers, their
replicas and jobs, which run in their own sessions) is stopped.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from output_match import learned_keys, match
from readme_blocks import Block, Command, parse

from gpucloud.control.workloads import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
VENV_BIN = Path(sys.executable).parent
LINKED = ("examples", "benchmarks", "Makefile", ".venv", "requirements.lock", "pyproject.toml")
SERVER = re.compile(r"^(?:\w+=\S+ )*(?:make run|gpucloud (?:serve|up|server))\b")
KILL_SERVER = re.compile(r"^kill -(?P<sig>\w+) \$\(pgrep -f '(?P<cmd>[^']+)'\)$")
EXPORT = re.compile(r"^export (?P<name>\w+)=(?P<value>.*)$", re.S)
PORT = re.compile(r"--port (\d{4,5})\b")
EXIT_CODE = re.compile(r"\s*\(exit code (\d+)\)\s*$", re.M)
READ_ONLY = re.compile(
    r"^(?:gpucloud (?:\w+ )?(?:list|get|logs|info)\b|gpucloud usage\b|cat |grep |head |tail |ls )"
)
ALLOWED_SKIPS = ("benchmark", "test suite", "server on the fixed default port", "download")
README_HOST = "vm"  # the host name of the machine the README's outputs come from
COMMAND_TIMEOUT = 240
RETRY_FOR = 150  # seconds a read-only command is retried until it shows what the README does
SERVER_STARTUP = 180

pytestmark = pytest.mark.timeout(900)

BLOCKS = parse(README.read_text())
SECTIONS = list(dict.fromkeys(b.section for b in BLOCKS))


class Session:
    """One reader following the README: a scratch clone, exported variables, servers."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "clone"
        self.dir.mkdir()
        for name in LINKED:
            (self.dir / name).symlink_to(ROOT / name)
        self.tmp = root / "tmp"  # stands for /tmp in the README's commands
        self.tmp.mkdir()
        self.marker = uuid.uuid4().hex
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCLOUD_")}
        self.env |= {
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
            "GPUCLOUD_HOME": str(root / "home"),
            "GPUCLOUD_DOC_TEST": self.marker,
            "PYTHONUNBUFFERED": "1",
        }
        for name in ("COLUMNS", "MAKEFLAGS", "MFLAGS", "MAKELEVEL"):  # as in a user's shell,
            self.env.pop(name, None)  # not inside `make test` (nested make says more)
        self.keys: dict[str, str] = {}  # API keys the README shows -> this run's
        self.ports: dict[str, str] = {}  # ports the README uses -> free ones
        self.servers: dict[str, tuple[subprocess.Popen, Path]] = {}

    # -- text the README shows, as this run needs it -------------------------------------
    def adapt(self, text: str) -> str:
        for old, new in self.keys.items():
            text = text.replace(old, new)
        for old, new in self.ports.items():
            text = re.sub(rf"(?<=[:\s]){old}\b", new, text)
        return re.sub(r"(?<![\w.])/tmp/", f"{self.tmp}/", text)

    def shown_paths(self, real: str) -> str:
        """Real output with this run's paths, and this machine's host name (the local
        node's name), as the README writes them: `/tmp/...` for the scratch /tmp, and
        `.../` for the clone's directory (the reader's clone is anywhere)."""
        real = real.replace(f"{self.tmp}/", "/tmp/").replace(f"{self.dir}/", ".../")
        return re.sub(rf"(?<![\w-]){re.escape(socket.gethostname())}(?![\w-])", README_HOST, real)

    def take_ports(self, text: str) -> None:
        for port in PORT.findall(text):
            self.ports.setdefault(port, str(free_port()))

    # -- running -------------------------------------------------------------------------
    def shell(self, command: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", command], cwd=self.dir, env=self.env, capture_output=True,
            text=True, timeout=COMMAND_TIMEOUT,
        )  # fmt: skip

    def run_command(self, cmd: Command, where: str) -> None:
        self.take_ports(cmd.text)
        text = self.adapt(cmd.text)
        if m := EXPORT.match(text):
            value = self.shell(f"printf %s {m['value']}").stdout
            self.env[m["name"]] = value
            return
        if m := KILL_SERVER.match(text):
            self.stop_server(m["cmd"], m["sig"], cmd, where)
            return
        if SERVER.match(text):
            self.start_server(text, cmd, where)
            return
        shown = EXIT_CODE.sub("", cmd.output)
        codes = EXIT_CODE.findall(cmd.output)
        # A failing command may say what it did before its error: the error comes last.
        fails = shown.strip().rpartition("\n")[2].lstrip().startswith("error:")
        deadline = time.monotonic() + (RETRY_FOR if READ_ONLY.match(text) else 0)
        while True:
            result = self.shell(text)
            real = result.stdout if result.returncode == 0 else result.stdout + result.stderr
            real = self.shown_paths(real)
            problem = _exit_problem(result.returncode, fails, codes)
            mismatch = match(shown, real) if shown.strip() and not problem else None
            if not problem and not mismatch:
                break
            if time.monotonic() > deadline:
                detail = problem or str(mismatch)
                pytest.fail(
                    f"{where}: $ {cmd.text}\n{detail}\n--- stdout ---\n{result.stdout[-4000:]}"
                    f"\n--- stderr ---\n{result.stderr[-4000:]}"
                )
            time.sleep(0.5)
        self.keys |= learned_keys(shown, real)

    def start_server(self, text: str, cmd: Command, where: str) -> None:
        log = self.dir.parent / f"server-{len(self.servers)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["bash", "-c", f"exec env {text}"], cwd=self.dir, env=self.env, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.servers[cmd.text] = (proc, log)
        deadline = time.monotonic() + SERVER_STARTUP
        while (mismatch := match(cmd.output, self.shown_paths(log.read_text()))) is not None:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{where}: server $ {cmd.text}\n{mismatch}\n{log.read_text()[-4000:]}")
            time.sleep(0.2)
        self.keys |= learned_keys(cmd.output, self.shown_paths(log.read_text()))

    def stop_server(self, started_as: str, sig: str, cmd: Command, where: str) -> None:
        found = [k for k in self.servers if started_as in k]
        assert len(found) == 1, f"{where}: no single server started as {started_as!r}: {found}"
        proc, log = self.servers.pop(found[0])
        before = len(log.read_text())
        proc.send_signal(getattr(signal, f"SIG{sig}"))
        code = proc.wait(timeout=120)
        real = self.shown_paths(log.read_text()[before:])
        assert code == 0, f"{where}: $ {cmd.text}: the server exited {code}\n{real[-4000:]}"
        if mismatch := match(cmd.output, real):
            pytest.fail(f"{where}: $ {cmd.text}\n{mismatch}")

    def run_pycon(self, block: Block, where: str) -> None:
        """Each `>>>` statement in one interpreter; its output compared with the shown one."""
        import doctest

        examples = doctest.DocTestParser().get_examples(self.adapt(block.body))
        sep = f"--- {self.marker} ---"
        driver = "\n".join(
            [f"print({sep!r})\nexec(compile({e.source!r}, '<README>', 'single'))" for e in examples]
        )
        result = self._python(driver)
        outputs = result.stdout.split(sep + "\n")[1:]
        assert result.returncode == 0 and len(outputs) == len(examples), (
            f"{where}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
        for example, real in zip(examples, outputs, strict=True):
            if mismatch := match(example.want, self.shown_paths(real)):
                pytest.fail(f"{where}: >>> {example.source}{mismatch}")

    def run_python(self, block: Block, where: str) -> None:
        self.take_ports(block.body)
        result = self._python(self.adapt(block.body))
        assert result.returncode == 0, f"{where}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        if block.output and (mismatch := match(block.output, self.shown_paths(result.stdout))):
            pytest.fail(f"{where}\n{mismatch}\n--- stdout ---\n{result.stdout[-3000:]}")

    def _python(self, code: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(VENV_BIN / "python"), "-c", code], cwd=self.dir, env=self.env,
            capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
        )  # fmt: skip

    def close(self) -> None:
        """Stop the servers, then every process of this run (replicas and jobs too)."""
        for proc, _ in self.servers.values():
            _signal_group(proc.pid, signal.SIGTERM)
        for proc, _ in self.servers.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
        for proc in _marked(self.marker):
            _signal_group(proc.pid, signal.SIGKILL)


def _exit_problem(code: int, fails: bool, codes: list[str]) -> str | None:
    if codes and code != int(codes[0]):
        return f"exit code {code}, the README shows {codes[0]}"
    if fails and code == 0:
        return "exit code 0, the README shows an error"
    if not fails and code != 0:
        return f"exit code {code}"
    return None


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _marked(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("GPUCLOUD_DOC_TEST") == marker:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    s = Session(tmp_path_factory.mktemp("readme"))
    yield s
    s.close()
    shutil.rmtree(s.dir.parent, ignore_errors=True)


@pytest.mark.parametrize("section", SECTIONS)
def test_readme_section_runs_as_shown(session, section):
    for block in (b for b in BLOCKS if b.section == section and not b.skip):
        where = f"README.md:{block.line} ({section})"
        if block.kind == "shell":
            for cmd in block.commands:
                session.run_command(cmd, f"README.md:{cmd.line}")
        elif block.kind == "pycon":
            session.run_pycon(block, where)
        elif block.kind == "python":
            session.run_python(block, where)


def test_skips_are_few_and_only_benchmarks_or_test_runs():
    skipped = [(b.line, b.skip) for b in BLOCKS if b.skip]
    assert all(reason.startswith(ALLOWED_SKIPS) for _, reason in skipped), skipped
    assert len(skipped) <= 10, skipped
    shown_benchmarks = [b.line for b in BLOCKS if b.kind == "shell" and not b.skip
                        and any("benchmarks/" in c.text for c in b.commands)]  # fmt: skip
    assert shown_benchmarks == [], "a benchmark block without its skip marker"


# -- the matcher: what it forgives and what it does not ------------------------------------

REAL = (
    "Jobs\n┏━━━━┳━━━━━━━━┓\n┃ id ┃ ran ┃\n│ 12 │ 1.02 s │\n└─┘\n"
    "key gpc_ZZ_top-9876 id cmpl-0123abcdef99"
)


def test_the_matcher_forgives_numbers_keys_ids_and_table_widths():
    shown = "┃ id ┃ ran      ┃\n│ 2  │ 535.4 ms │\nkey gpc_abcdefgh12 id cmpl-4fae12ab90"
    assert match("Jobs\n" + shown, REAL) is None
    assert match("...\n│ 12 │ 1.02 s │\n...", REAL) is None
    assert match("... (abridged)\nkey ... id cmpl-4fae12ab90", REAL) is None
    assert match("... │ 1.02 s │\n...", REAL) is None
    assert learned_keys("key gpc_abcdefgh12", REAL) == {"gpc_abcdefgh12": "gpc_ZZ_top-9876"}


@pytest.mark.parametrize(
    "shown",
    [
        "Jobs\n┃ id ┃ ran ┃\n│ 12 │ 1.02 s │\nkey gpc_x id cmpl-1",  # a key that is not one
        "Jobs\n┃ id ┃ time ┃",  # a word
        "┃ id ┃ ran ┃\nJobs",  # the order of lines
        "Jobs\n┃ id ┃ ran ┃",  # a line left out at the end, with no marker
        "Jobs\n┃ id ┃ ran ┃\n│ 12 │ 1.02 s │ extra │",
    ],
)
def test_the_matcher_does_not_forgive_words_order_or_missing_lines(shown):
    assert match(shown, REAL) is not None


# -- every `gpucloud ...` that the README and the examples name exists -----------------------


def _cli_mentions() -> list[tuple[str, str]]:
    """(where, text after `gpucloud `) for each command line, code span and example comment."""
    found = []
    for block in BLOCKS:
        for cmd in block.commands:
            found += [(f"README.md:{cmd.line}", m) for m in _after_gpucloud(cmd.text)]
    for n, line in enumerate(README.read_text().splitlines(), 1):
        for span in re.findall(r"`([^`]+)`", line):
            found += [(f"README.md:{n}", m) for m in _after_gpucloud(span)]
    for path in sorted((ROOT / "examples").rglob("*")):
        if path.suffix in (".toml", ".yaml", ".py", ".md"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                where = f"{path.relative_to(ROOT)}:{n}"
                spans = re.findall(r"`([^`]+)`", line)
                if line.lstrip("# ").startswith("gpucloud "):  # a command in a comment
                    spans.append(line.lstrip("# "))
                found += [(where, m) for span in spans for m in _after_gpucloud(span)]
    return found


def _after_gpucloud(text: str) -> list[str]:
    return [
        m.group(1).split("|")[0].split(";")[0].split("#")[0].split(")")[0]
        for m in re.finditer(r"(?<![\w/.-])gpucloud ((?:[a-z][\w-]*)(?:[^\n`'\"]*))", text)
    ]


def test_every_gpucloud_command_and_flag_the_readme_and_examples_name_exists():
    import typer

    from gpucloud.cli.main import _app

    root = typer.main.get_command(_app)
    mentions = _cli_mentions()
    problems = []
    for where, text in mentions:
        words = text.replace("[", " ").replace("]", " ").split()
        cmd, path = root, ["gpucloud"]
        for word in words:
            subs = getattr(cmd, "commands", None)
            if subs is None or not re.fullmatch(r"[a-z][a-z-]*", word):
                break
            if word not in subs:
                problems.append(f"{where}: `{' '.join(path)}` has no command {word!r}")
                break
            cmd, path = subs[word], [*path, word]
        if getattr(cmd, "commands", None) is not None:
            continue  # a group named in prose
        flags = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        for word in words:
            flag = word.split("=")[0]
            if flag.startswith("--") and flag not in flags:
                problems.append(f"{where}: `{' '.join(path)}` has no option {flag}")
    assert len(mentions) > 50
    assert problems == []


def test_every_file_the_readme_names_exists():
    named = re.findall(
        r"(?<![\w/.])((?:benchmarks|examples|docs|gpucloud|tests)/[\w./-]+\.(?:py|md|toml|yaml|csv|cpp))",
        README.read_text(),
    )
    assert len(named) > 10
    assert [n for n in sorted(set(named)) if not (ROOT / n).exists()] == []
