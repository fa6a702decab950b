"""Uploads are untrusted archives: only files and dirs that stay inside the upload land, in
the tenant's area, owned by its user; an archive that tries anything else is refused with a
4xx saying what, and a link the tenant planted in its area is never followed."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import httpx
import pytest
from http_wire import send_and_read

from gpucloud.errors import UserError

from .conftest import Server


@pytest.fixture
def shared_server(sqlite_server):
    """Uploads touch the filesystem, not the store: one database is enough."""
    return sqlite_server


def _archive(tmp_path: Path, *members: tuple[tarfile.TarInfo, bytes | None]) -> Path:
    path = tmp_path / "upload.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def _special(name: str, kind: bytes, target: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def _team(server: Server, name: str):
    return server.tenant(name)


def test_an_upload_lands_in_the_tenants_area_owned_by_its_user(shared_server, tmp_path):
    team = _team(shared_server, "up-owner")
    done = team.upload(_archive(tmp_path, _file("src/main.py", b"print(1)\n"), _file("a.txt")))
    area = shared_server.home / "tenants" / "up-owner"
    path = Path(done["path"])
    assert path.parent == area / "uploads" and (done["files"], done["bytes"]) == (2, 10)
    assert (path / "src" / "main.py").read_text() == "print(1)\n"
    if os.geteuid() == 0:  # the tenant's own uid, not root's
        owners = {p.stat().st_uid for p in [path, *path.rglob("*")]}
        assert owners == {area.stat().st_uid} and 0 not in owners
    again = team.upload(_archive(tmp_path, _file("a.txt")))
    assert again["path"] != done["path"]  # each upload its own dir


@pytest.mark.parametrize(
    ("member", "says"),
    [
        (_file("../escape.txt"), "'../escape.txt', an absolute path or one that leaves"),
        (_file("/etc/evil.txt"), "'/etc/evil.txt', an absolute path or one that leaves"),
        (_special("link", tarfile.SYMTYPE, "/etc/shadow"), "'link', which is neither a file"),
        (_special("hard", tarfile.LNKTYPE, "/etc/shadow"), "'hard', which is neither a file"),
        (_special("dev", tarfile.CHRTYPE), "'dev', which is neither a file nor a directory"),
        (_special("fifo", tarfile.FIFOTYPE), "'fifo', which is neither a file nor a directory"),
    ],
)
def test_archives_that_reach_outside_the_upload_are_refused(shared_server, tmp_path, member, says):
    team = _team(shared_server, f"up-bad-{abs(hash(says)) % 10**6}")
    with pytest.raises(UserError, match=says):
        team.upload(_archive(tmp_path, _file("ok.txt"), member))
    assert not (tmp_path.parent / "escape.txt").exists()
    area = shared_server.home / "tenants" / team.get("/me")["tenant"]
    assert not list((area / "uploads").iterdir()) if (area / "uploads").exists() else True
    assert not list((shared_server.home / "staging").glob("*/"))  # nothing half-unpacked


def test_not_an_archive_and_too_large_are_4xx(shared_server, tmp_path):
    team = _team(shared_server, "up-limits")
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"this is not gzip")
    with pytest.raises(UserError, match="not a valid gzipped tar archive"):
        team.upload(junk)
    head = (
        "POST /api/v1/uploads HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
        f"Authorization: Bearer {shared_server.admin_key}\r\nContent-Length: {10**12}\r\n\r\n"
    )
    answer = send_and_read(shared_server.url, head.encode(), b"\x1f\x8b")
    assert answer.startswith(b"HTTP/1.1 413") and b"upload too large" in answer
    # A bomb: small compressed, over the limit unpacked (the server's limit is 256 MiB).
    bomb = tmp_path / "bomb.tar.gz"
    with tarfile.open(bomb, "w:gz") as tar:
        info = tarfile.TarInfo("zeros")
        info.size = 300 << 20
        tar.addfile(info, _Zeros(info.size))
    with pytest.raises(UserError, match="unpacks to more than the limit"):
        team.upload(bomb)
    url = f"{shared_server.url}/api/v1/uploads"
    assert httpx.post(url, content=b"x").status_code == 401  # a key is needed


def test_a_link_planted_in_place_of_uploads_is_not_followed(shared_server, tmp_path):
    team = _team(shared_server, "up-link")
    first = Path(team.upload(_archive(tmp_path, _file("a.txt")))["path"])
    uploads = first.parent
    outside = tmp_path / "outside"
    outside.mkdir()
    moved = uploads.with_name("uploads-old")
    uploads.rename(moved)
    uploads.symlink_to(outside)  # what the tenant's job could do in its own area
    with pytest.raises(UserError, match="uploads is not a directory"):
        team.upload(_archive(tmp_path, _file("b.txt")))
    assert list(outside.iterdir()) == []


class _Zeros(io.RawIOBase):
    """`size` zero bytes, never held in memory at once."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n
