"""References to registered models: `NAME:VERSION`, or `NAME` (or `NAME:latest`) for the
newest version. Deployments, rollouts and `gpucloud eval` accept one where they take a
model directory."""

from __future__ import annotations

import os
import re
from typing import Annotated

from pydantic import Field, StringConstraints

from gpucloud.errors import UserError

REF = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]{0,62})(?::(\d{1,9}|latest))?$")
ModelRef = Annotated[
    str,
    StringConstraints(strip_whitespace=True, pattern=REF.pattern),
    Field(description="a registered model: NAME:VERSION, or NAME for its latest version"),
]


def parse_ref(ref: str) -> tuple[str, int | None]:
    """(name, version number, None for the latest) of a reference. Raises UserError."""
    m = REF.match(ref.strip())
    if m is None:
        raise UserError(
            f"{ref!r} is not a model reference: use NAME:VERSION (e.g. chat:3) or NAME for "
            "its latest version"
        )
    version = m.group(2)
    return m.group(1), None if version in (None, "latest") else int(version)


def names_registered_model(text: str) -> bool:
    """Whether a CLI model argument names a registered model: it reads as a reference and
    is no existing path (a URL or a path with a slash never reads as one)."""
    return REF.match(text.strip()) is not None and not os.path.exists(text)
