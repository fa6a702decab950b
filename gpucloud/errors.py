"""One exception tree for the whole project.

User errors carry a message a user can act on: what was wrong, what is allowed and, for
names, the closest valid one. The CLI maps `UserError` to exit code 2; the control plane
maps each class to an HTTP status in one place.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class GpucloudError(Exception):
    """Root of every error gpucloud raises on purpose."""


class UserError(GpucloudError):
    """Bad input: a flag, a file, a request. Never a bug."""


class TooLargeError(UserError):
    """Input over a size limit (an upload, a body)."""


class NotFoundError(UserError):
    """A named thing (model, GPU type, job, ...) does not exist."""


class ConfigError(UserError):
    """A config or spec file that cannot work."""


class CapacityError(GpucloudError):
    """The request is valid but cannot fit in the resources available."""


def unknown_name(kind: str, name: str, choices: Iterable[str]) -> NotFoundError:
    """A NotFoundError naming the closest valid choices, e.g. for a typo in a GPU name."""
    choices = sorted(choices)
    close = difflib.get_close_matches(name, choices, n=3, cutoff=0.4)
    if not close:
        lowered = {c.lower(): c for c in choices}
        close = difflib.get_close_matches(name.lower(), list(lowered), n=3, cutoff=0.4)
        close = [lowered[c] for c in close]
    hint = f"did you mean {', '.join(close)}?" if close else f"choose one of {', '.join(choices)}"
    return NotFoundError(f"unknown {kind} {name!r}: {hint}")
