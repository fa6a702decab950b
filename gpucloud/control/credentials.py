"""The CLI's credentials file (HOME/credentials.json, mode 0600): server URL and API key.

GPUCLOUD_URL and GPUCLOUD_API_KEY override what the file says.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from gpucloud.control.config import home
from gpucloud.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Credentials:
    url: str
    api_key: str


def path() -> Path:
    return home() / "credentials.json"


def save(url: str, api_key: str) -> Path:
    """Write the file readable only by this user; returns its path."""
    p = path()
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "api_key": api_key}, f)
    os.chmod(p, 0o600)  # the file may have existed with wider permissions
    return p


def load() -> Credentials:
    """The URL and key to use. Raises ConfigError when neither file nor environment has them."""
    data: dict[str, str] = {}
    p = path()
    if p.exists():
        try:
            data = json.loads(p.read_text())
        except ValueError as e:
            raise ConfigError(f"cannot read {p}: {e}; run gpucloud login again") from None
    url = os.environ.get("GPUCLOUD_URL") or data.get("url")
    key = os.environ.get("GPUCLOUD_API_KEY") or data.get("api_key")
    if not url or not key:
        raise ConfigError(
            "not logged in: run `gpucloud up`, or `gpucloud login URL --api-key KEY`, "
            "or set GPUCLOUD_URL and GPUCLOUD_API_KEY"
        )
    return Credentials(url.rstrip("/"), key)
