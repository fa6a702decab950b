"""The multipart/form-data reader of /v1/files: a form split anywhere across chunks, its
file streamed to disk within the limit, malformed bodies refused with what was wrong."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gpucloud.control import multipart
from gpucloud.errors import TooLargeError, UserError


def _form(content: bytes) -> tuple[bytes, str]:
    """A body as httpx (so the openai client) encodes it, and its Content-Type."""
    request = httpx.Request(
        "POST", "http://x/", data={"purpose": "batch"}, files={"file": ("in.jsonl", content)}
    )
    return request.read(), request.headers["content-type"]


def _read(body: bytes, kind: str, dest, limit: int = 1 << 20, chunk: int = 7):
    async def chunks():
        for i in range(0, len(body), chunk):
            yield body[i : i + chunk]

    return asyncio.run(multipart.read(chunks(), kind, "file", dest, limit))


@pytest.mark.parametrize("chunk", [1, 5, 1 << 16])
def test_a_form_is_read_whatever_its_chunks(tmp_path, chunk):
    content = b'{"a": 1}\r\n--not-the-boundary\r\n' * 50
    body, kind = _form(content)
    form = _read(body, kind, tmp_path / "f", chunk=chunk)
    assert (form.fields, form.filename) == ({"purpose": "batch"}, "in.jsonl")
    assert form.bytes == len(content)
    assert (tmp_path / "f").read_bytes() == content


def test_bad_forms_are_refused(tmp_path):
    body, kind = _form(b"x" * 100)
    with pytest.raises(TooLargeError, match="the limit is 99 bytes"):
        _read(body, kind, tmp_path / "f", limit=99)
    with pytest.raises(UserError, match="ends before its closing boundary"):
        _read(body[:-10], kind, tmp_path / "f")
    with pytest.raises(UserError, match="must be multipart/form-data"):
        _read(body, "application/json", tmp_path / "f")
