"""A tenant's uploaded directory (a gzipped tar), unpacked into its area: what a job runs
in when the CLI submits it from a directory the tenant's user cannot reach.

The archive is untrusted. It is unpacked by the control plane's user into a staging dir
of its own (never inside the tenant's area, where the tenant's processes could swap a
component for a symlink while root writes), with only regular files and directories
accepted, paths that stay inside the upload, the unpacked size and file count bounded;
then handed to the tenant's user and moved into `uploads/` of its area through directory
descriptors opened with O_NOFOLLOW, so no symlink the tenant planted is followed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from gpucloud.control.sandbox import Identity
from gpucloud.errors import UserError

MAX_FILES = 100_000


@dataclass(frozen=True, slots=True)
class Unpacked:
    path: Path
    files: int
    bytes: int


def unpack(archive: Path, staging: Path, area: Path, who: Identity | None, limit: int) -> Unpacked:
    """Unpack `archive` (tar.gz) into a new dir of `area`/uploads owned by `who`, by way of
    `staging` (an existing dir only this process writes). Raises UserError saying what in
    the archive was refused."""
    name = secrets.token_hex(8)
    target = staging / name
    target.mkdir(mode=0o700)
    try:
        files, size = _extract(archive, target, limit)
        if who is not None:
            _hand_over(target, who)
        target.chmod(0o700)
        _move_into(target, area, name, who)
    finally:
        shutil.rmtree(target, ignore_errors=True)  # left only if something failed
    return Unpacked(area / "uploads" / name, files, size)


def _extract(archive: Path, target: Path, limit: int) -> tuple[int, int]:
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = _checked(tar, limit)
            tar.extractall(target, members=members, filter="data")
    except tarfile.FilterError as e:  # the second net: _checked refused these already
        raise _leaves(e.tarinfo.name) from None
    except (tarfile.TarError, EOFError, zlib.error) as e:
        raise UserError(f"the upload is not a valid gzipped tar archive: {e}") from None
    return sum(m.isfile() for m in members), sum(m.size for m in members if m.isfile())


def _checked(tar: tarfile.TarFile, limit: int) -> list[tarfile.TarInfo]:
    """The archive's members, once each is known to be a plain file or dir and the whole
    fits the limits (read from the headers, before anything is written)."""
    members, total = [], 0
    for m in tar:
        if m.name.startswith("/") or ".." in Path(m.name).parts:
            raise _leaves(m.name)
        if not (m.isfile() or m.isdir()):
            raise UserError(
                f"the upload holds {m.name!r}, which is neither a file nor a directory: "
                "uploads hold only regular files and directories (no links or devices)"
            )
        total += m.size
        if total > limit:
            raise UserError(f"the upload unpacks to more than the limit of {limit} bytes")
        members.append(m)
        if len(members) > MAX_FILES:
            raise UserError(f"the upload holds more than {MAX_FILES} entries")
    return members


def _leaves(name: str) -> UserError:
    return UserError(
        f"the upload holds {name!r}, an absolute path or one that leaves the upload: "
        "paths must be relative and stay inside it"
    )


def _hand_over(root: Path, who: Identity) -> None:
    """Every file and dir under `root` owned by the tenant's user (no link is followed:
    the archive held none, and only this process can write the staging dir)."""
    for parent, dirs, files in os.walk(root):
        for entry in [parent, *(os.path.join(parent, n) for n in dirs + files)]:
            os.chown(entry, who.uid, who.gid, follow_symlinks=False)


def _move_into(target: Path, area: Path, name: str, who: Identity | None) -> None:
    """Move the unpacked dir to `area`/uploads/`name`, without following any link the
    tenant may have put in place of `uploads`."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    area_fd = os.open(area, flags)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir("uploads", 0o700, dir_fd=area_fd)
            if who is not None:
                os.chown("uploads", who.uid, who.gid, dir_fd=area_fd, follow_symlinks=False)
        try:
            uploads_fd = os.open("uploads", flags, dir_fd=area_fd)
        except OSError as e:
            raise UserError(f"{area}/uploads is not a directory: remove it and upload again") from e
        try:
            os.rename(target, name, dst_dir_fd=uploads_fd)
        finally:
            os.close(uploads_fd)
    finally:
        os.close(area_fd)
