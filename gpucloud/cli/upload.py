"""Send a local directory to the control plane (`POST /uploads`): what a job's workdir or a
deployment's model dir becomes when the tenant's workloads, which run as the tenant's own
OS user in a sandbox, could not reach it where it is (see gpucloud.control.uploads).

Left out: version control, virtual environments and caches (SKIPPED), and whatever the
directory's `.gpucloudignore` lists (one shell pattern per line, matched against paths
relative to the directory and against each name). Links are sent as what they point to
(a linked dir that leads back to one of its own ancestors is left out: a loop), and
anything that is neither a file nor a dir is left out.
"""

from __future__ import annotations

import fnmatch
import os
import tarfile
import tempfile
from pathlib import Path

from gpucloud.cli.output import err_console, human_bytes
from gpucloud.control.client import Client
from gpucloud.errors import UserError

SKIPPED = (".git", ".hg", ".venv", "venv", "__pycache__", ".pytest_cache", ".ruff_cache")
IGNORE_FILE = ".gpucloudignore"


def upload(client: Client, directory: Path) -> str:
    """Pack `directory`, send it, say so on stderr; the path it has on the control plane."""
    if not directory.is_dir():
        raise UserError(f"{directory} is not a directory: only a directory can be uploaded")
    with tempfile.TemporaryDirectory(prefix="gpucloud-upload-") as tmp:
        archive = Path(tmp) / "upload.tar.gz"
        _pack(directory, archive)
        done = client.upload(archive)
    err_console.print(
        f"uploaded {directory} ({done['files']} file{'' if done['files'] == 1 else 's'}, "
        f"{human_bytes(done['bytes'])})",
        highlight=False,
    )
    return done["path"]


def _pack(directory: Path, archive: Path) -> None:
    ignored = _patterns(directory / IGNORE_FILE)
    with tarfile.open(archive, "w:gz", compresslevel=1, dereference=True) as tar:
        for parent, dirs, files in os.walk(directory, followlinks=True):
            here = Path(parent)
            rel_dir = here.relative_to(directory)
            real = here.resolve()  # a linked dir leading back to an ancestor is a loop
            dirs[:] = sorted(
                d
                for d in dirs
                if not _skipped(rel_dir / d, ignored)
                and not real.is_relative_to((here / d).resolve())
            )
            for d in dirs:
                tar.add(here / d, arcname=str(rel_dir / d), recursive=False)
            for name in sorted(files):
                rel = rel_dir / name
                if not _skipped(rel, ignored) and (here / name).is_file():
                    tar.add(here / name, arcname=str(rel), recursive=False)


def _patterns(path: Path) -> list[str]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    return [p.strip().strip("/") for p in lines if p.strip() and not p.startswith("#")]


def _skipped(rel: Path, patterns: list[str]) -> bool:
    if rel.name in SKIPPED:
        return True
    return any(fnmatch.fnmatch(str(rel), p) or fnmatch.fnmatch(rel.name, p) for p in patterns)


def into_upload(value: str, local: Path, remote: str) -> str:
    """A path of the spec, rewritten to the uploaded copy when it lies in the uploaded dir
    (a relative one is relative to the current directory); others are left as they are."""
    path = Path(os.path.abspath(value))
    if path == local or path.is_relative_to(local):
        return str(Path(remote) / path.relative_to(local))
    return value if os.path.isabs(value) else str(path)
