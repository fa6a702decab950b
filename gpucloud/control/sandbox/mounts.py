"""The sandbox's filesystem as bwrap arguments: the system read-only, a private /tmp and
/dev/shm, the hidden dirs covered by an empty tmpfs, the tenant's dirs bound read-write,
the installation and the readable dirs bound read-only, every one at its own path.

A bound dir is useless if the tenant cannot walk to it: an ancestor the tenant may not
traverse (e.g. /root, where pyenv or the venv may live) is covered by a tmpfs in which
only the bound dirs appear; ancestors inside a tmpfs are made traversable (0755)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def installation() -> list[Path]:
    """The dirs a workload needs to run this installation's Python: its prefixes (the venv
    and the interpreter it was made from) and the dir the package was imported from."""
    package_root = Path(__file__).resolve().parents[3]  # .../<root>/gpucloud/control/sandbox
    dirs = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    dirs.add(package_root)
    return sorted(d for d in dirs if not any(d != o and d.is_relative_to(o) for o in dirs))


class Mounts:
    """Builds the mount arguments in an order where no mount hides an earlier one."""

    def __init__(self) -> None:
        self.args = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        for shared in ("/dev/shm", "/tmp"):  # private, and writable by anyone as usual
            self.args += ["--perms", "1777", "--tmpfs", shared]
        self.tmpfs = [Path("/dev/shm"), Path("/tmp")]
        self.made: set[Path] = set()

    def hide(self, path: Path) -> None:
        self._reach(path)
        self.args += ["--perms", "0755", "--tmpfs", str(path)]
        self.tmpfs.append(path)

    def bind(self, path: Path, *, writable: bool) -> None:
        self._reach(path)
        self.args += ["--bind" if writable else "--ro-bind", str(path), str(path)]

    def device(self, path: Path) -> None:
        self.args += ["--dev-bind", str(path), str(path)]

    def _reach(self, path: Path) -> None:
        for a in reversed(path.parents[:-1]):  # from the top, "/" excluded
            if a in self.made or a in self.tmpfs:
                continue
            if any(a.is_relative_to(t) for t in self.tmpfs):
                self.args += ["--perms", "0755", "--dir", str(a)]
                self.made.add(a)
            elif not _traversable(a):
                self.args += ["--perms", "0755", "--tmpfs", str(a)]
                self.tmpfs.append(a)


def _traversable(path: Path) -> bool:
    try:
        return bool(os.stat(path).st_mode & 0o001)
    except OSError:
        return True  # bwrap will say what is missing
