"""A Batch API input file: JSONL, one request a line, as OpenAI's Batch API takes it:

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

`parse` checks every line before a batch is accepted, so a batch never starts on a file
it would stop halfway through: each problem is reported with its line number.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpucloud.errors import UserError
from gpucloud.http_body import BadBody, loads

# What a batch's requests may go to: the gateway's routes that answer a whole request.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_LINES = 50_000  # OpenAI's bound on one batch
MAX_CUSTOM_ID = 512


@dataclass(frozen=True, slots=True)
class Line:
    custom_id: str
    url: str
    body: dict


def parse(data: bytes, endpoint: str) -> list[Line]:
    """The requests of a JSONL file whose lines all go to `endpoint` (blank lines are
    skipped). Raises UserError naming the first line at fault and what it must be."""
    lines: list[Line] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        line = _line(raw, number, endpoint)
        if line.custom_id in seen:
            raise UserError(
                f"line {number}: custom_id {line.custom_id!r} is used twice: "
                "each line needs its own"
            )
        seen.add(line.custom_id)
        lines.append(line)
        if len(lines) > MAX_LINES:
            raise UserError(f"the input file holds more than {MAX_LINES} requests")
    if not lines:
        raise UserError("the input file holds no request: one JSON object a line")
    return lines


def _line(raw: bytes, number: int, endpoint: str) -> Line:
    try:
        value = loads(raw)
    except BadBody as e:
        raise UserError(f"line {number} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise UserError(f"line {number} must be a JSON object with custom_id, method, url and body")
    custom_id, method, url, body = (value.get(k) for k in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
        raise UserError(
            f"line {number}: custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters"
        )
    if method != "POST":
        raise UserError(f"line {number}: method must be 'POST' (got {method!r})")
    if url != endpoint:
        raise UserError(
            f"line {number}: url {url!r} is not the batch's endpoint {endpoint!r}: "
            "every line goes to it"
        )
    if not isinstance(body, dict):
        raise UserError(f"line {number}: body must be a JSON object (the request to {endpoint})")
    if body.get("stream"):
        raise UserError(f"line {number}: a batch's requests cannot stream: drop 'stream'")
    return Line(custom_id, url, body)
