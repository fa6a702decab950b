"""The control plane's own branches of gpucloud's exception tree (mapped to HTTP in app.py)."""

from __future__ import annotations

from gpucloud.errors import UserError


class AuthError(UserError):
    """No API key, or one that is unknown or revoked (HTTP 401)."""


class ForbiddenError(UserError):
    """The key is valid but its role may not do this (HTTP 403)."""


class ConflictError(UserError):
    """The request clashes with the current state, e.g. a duplicate name (HTTP 409)."""
