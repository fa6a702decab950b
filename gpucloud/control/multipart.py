"""A multipart/form-data body (RFC 7578) read as it streams in: its one file part written
to disk within a size limit, its other fields kept as text. Enough for OpenAI's
`files.create` (a `file` part and a `purpose` field) and `curl -F`, with nothing held
whole in memory.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path
from typing import BinaryIO

from gpucloud.errors import TooLargeError, UserError

MAX_HEADERS = 16 << 10  # bytes of one part's headers
MAX_FIELD = 64 << 10  # bytes of one field that is not the file


@dataclass(slots=True)
class Form:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None  # the file part's, None if the body had none
    bytes: int = 0  # the file's size


def boundary(content_type: str) -> bytes:
    """The boundary of a multipart/form-data Content-Type. Raises UserError for another
    type, or one with no boundary."""
    header = Message()
    header["content-type"] = content_type
    found = header.get_boundary()
    if header.get_content_type() != "multipart/form-data" or not found:
        raise UserError(
            f"the body must be multipart/form-data with a boundary (got {content_type!r}): "
            "send the file as a form field named 'file'"
        )
    return found.encode("latin-1")


async def read(
    chunks: AsyncIterator[bytes], content_type: str, file_field: str, dest: Path, limit: int
) -> Form:
    """Read a form from `chunks`: the part named `file_field` written to `dest` (at most
    `limit` bytes), the others into `Form.fields`. Raises UserError for a malformed body,
    TooLargeError past the limit."""
    parser = _Parser(boundary(content_type), file_field, limit)
    with dest.open("wb") as out:
        parser.out = out
        async for chunk in chunks:
            parser.feed(chunk)
        if parser.state != "done":
            raise UserError("the multipart body ends before its closing boundary")
    return parser.form


class _Parser:
    def __init__(self, boundary: bytes, file_field: str, limit: int) -> None:
        self.delimiter = b"\r\n--" + boundary
        self.file_field, self.limit = file_field, limit
        self.buffer = b"\r\n"  # so the first boundary reads like every later one
        self.state = "preamble"
        self.form = Form()
        self.out: BinaryIO | None = None
        self.part: str | None = None  # the name of the part being read
        self.value = bytearray()

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        while getattr(self, "_" + self.state)():
            pass

    # Each state's step consumes what it can of the buffer; False: it needs more bytes.
    def _preamble(self) -> bool:
        at = self.buffer.find(self.delimiter)
        if at < 0:
            self.buffer = self.buffer[-len(self.delimiter) :]
            return False
        self.buffer = self.buffer[at + len(self.delimiter) :]
        self.state = "boundary"
        return True

    def _boundary(self) -> bool:
        if len(self.buffer) < 2:
            return False
        ending, self.buffer = self.buffer[:2], self.buffer[2:]
        if ending not in (b"--", b"\r\n"):
            raise UserError(
                "malformed multipart body: a boundary is followed by neither CRLF nor --"
            )
        self.state = "done" if ending == b"--" else "headers"
        return ending != b"--"

    def _headers(self) -> bool:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEADERS:
                raise UserError(f"a multipart part's headers exceed {MAX_HEADERS} bytes")
            return False
        self._start_part(self.buffer[:end].decode("latin-1"))
        self.buffer = self.buffer[end + 4 :]
        self.state = "body"
        return True

    def _body(self) -> bool:
        at = self.buffer.find(self.delimiter)
        keep = len(self.delimiter) - 1 if at < 0 else 0  # may be a delimiter's start
        data = self.buffer[: at if at >= 0 else max(0, len(self.buffer) - keep)]
        self.buffer = self.buffer[len(data) :]
        self._write(data)
        if at < 0:
            return False
        self.buffer = self.buffer[len(self.delimiter) :]
        self._end_part()
        self.state = "boundary"
        return True

    def _done(self) -> bool:
        return False  # an epilogue after the closing boundary is ignored

    def _start_part(self, headers: str) -> None:
        disposition = Message()
        for line in headers.split("\r\n"):
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-disposition":
                disposition["content-disposition"] = value.strip()
        self.part = disposition.get_param("name", header="content-disposition")
        if not isinstance(self.part, str):
            raise UserError("malformed multipart body: a part has no name")
        if self.part == self.file_field:
            if self.form.filename is not None:
                raise UserError(f"the form holds more than one {self.file_field!r} part")
            self.form.filename = disposition.get_filename() or self.file_field

    def _write(self, data: bytes) -> None:
        if self.part == self.file_field:
            self.form.bytes += len(data)
            if self.form.bytes > self.limit:
                raise TooLargeError(f"file too large: the limit is {self.limit} bytes")
            assert self.out is not None
            self.out.write(data)
        else:
            self.value += data
            if len(self.value) > MAX_FIELD:
                raise UserError(f"form field {self.part!r} exceeds {MAX_FIELD} bytes")

    def _end_part(self) -> None:
        if self.part != self.file_field:
            self.form.fields[self.part] = self.value.decode("utf-8", "replace")
        self.value = bytearray()
        self.part = None
