"""Run the `gpucloud` entry point in this process, as a shell would run the command: through
`gpucloud.cli.main.app`, which turns errors into one line and an exit code."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest

from gpucloud.cli import main


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def run_cli(capsys, monkeypatch, *argv: str) -> Result:
    """`gpucloud ARGV...`, with its exit code and what it printed."""
    monkeypatch.setattr(sys, "argv", ["gpucloud", *argv])
    with pytest.raises(SystemExit) as exit_:
        main.app()
    out = capsys.readouterr()
    return Result(exit_.value.code or 0, out.out, out.err)
