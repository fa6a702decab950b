"""One node's share of a workload on a Ray cluster: the Ray actor that runs the launch's
command on its node, in that node's sandbox, and hands back the command's output and exit
code when the control plane asks (executors.ray creates one per node of a placement).

It runs inside a Ray worker process on the node, so it imports nothing of the control
plane: only the sandbox, which every executor starts workloads through. The command's
output goes to a file on the node; each `report` returns the complete lines written since
the previous one, so the control plane can append them to its own log store.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from gpucloud.control.sandbox import SETUP_FAILED, Sandbox, SandboxError, Spec

_CHUNK = 1 << 20  # the most output one report carries: a busy rank's log is read in steps


@dataclass(frozen=True, slots=True)
class Report:
    """What one node's share did since the last report. `ended` once its command ended
    (then `code` is its exit code, None if unknown); `error` when it could not start."""

    output: bytes
    ended: bool = False
    code: int | None = None
    error: str | None = None


class NodeLauncher:
    """Started by Ray on the node of its placement-group bundle; starts `spec`'s command
    there at once. `spec.log_path` and `spec.exit_path` are replaced by files of its own."""

    def __init__(self, scope: str, spec: Spec) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"gpucloud-{spec.name}-"))
        self.spec = replace(spec, log_path=self.dir / "output.log", exit_path=self.dir / "exit")
        self.offset = 0
        self.final: Report | None = None
        self.proc = None
        try:
            self.spec.log_path.touch(mode=0o600)
            self.sandbox = Sandbox(scope)
            # The rank dies with this actor: a launcher that crashed (or was killed with its
            # node's worker process) leaves no command running that nothing reports.
            self.proc = self.sandbox.start(self.spec, die_with_parent=True)
        except (OSError, ValueError, SandboxError) as e:  # ValueError: a NUL byte
            self.final = Report(b"", ended=True, error=f"could not start: {e}")

    def report(self) -> Report:
        """The output since the last report, and whether (and how) the command ended."""
        if self.final is not None:
            final, self.final = self.final, Report(b"", ended=True, code=self.final.code)
            return final
        code = self.proc.poll()
        if code is None:
            return Report(self._read(whole_lines=True))
        return self._ended(code)

    def stop(self, grace: float) -> Report:
        """SIGTERM the command's processes, SIGKILL after `grace` seconds; its last report."""
        if self.proc is not None and self.final is None:
            self.sandbox.stop(self.spec.name, self.proc.pid, grace)
            return self._ended(self.proc.wait())
        return self.report()

    def _ended(self, fallback: int) -> Report:
        reason = self.sandbox.finish(self.spec.name, self.proc.pid)
        code = _recorded(self.spec.exit_path, fallback)
        output = self._read(whole_lines=False)
        if len(output) == _CHUNK:  # more to come: ended, but not yet all said
            return Report(output)
        error = reason
        if code == SETUP_FAILED and reason is None:
            lines = [line for line in output.decode(errors="replace").splitlines() if line]
            error = f"could not start: {lines[-1] if lines else 'its sandbox failed'}"
        shutil.rmtree(self.dir, ignore_errors=True)
        self.final = Report(b"", ended=True, code=code)
        return Report(output, ended=True, code=code, error=error)

    def _read(self, whole_lines: bool) -> bytes:
        with self.spec.log_path.open("rb") as f:
            f.seek(self.offset)
            data = f.read(_CHUNK)
        if whole_lines and len(data) < _CHUNK:
            data = data[: data.rfind(b"\n") + 1]
        self.offset += len(data)
        return data


def _recorded(exit_path: Path, fallback: int | None) -> int | None:
    try:
        return int(exit_path.read_text().strip())
    except (OSError, ValueError):
        return fallback
