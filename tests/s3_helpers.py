"""A real S3-compatible server (moto in server mode) on 127.0.0.1 for the shared-storage tests.

`s3_server` starts it as a process and stops that process by its pid; meanwhile the test
process has the standard AWS environment pointing at it (as a user would set it), so
subprocesses such as `gpucloud train` and `gpucloud serve` inherit it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


@dataclass
class S3Server:
    endpoint: str
    env: dict[str, str]

    def filesystem(self):
        """An s3fs client of this server (for setting up and inspecting buckets)."""
        import s3fs

        return s3fs.S3FileSystem(use_listings_cache=False, skip_instance_cache=True)

    def bucket(self, name: str) -> str:
        self.filesystem().mkdir(name)
        return f"s3://{name}"

    def upload(self, local_dir: Path, url: str) -> str:
        """Copy the files of `local_dir` under `url` (s3://bucket/prefix); returns `url`."""
        fs = self.filesystem()
        for file in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            fs.put_file(str(file), f"{url}/{file.relative_to(local_dir).as_posix()}")
        return url


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_server(workdir: Path) -> Iterator[S3Server]:
    """Run moto's S3 server; set AWS_* (and a storage cache under `workdir`) meanwhile."""
    port = _free_port()
    log = workdir / "moto.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "test-key",
        "AWS_SECRET_ACCESS_KEY": "test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        # Nothing of this machine's own AWS setup may leak in.
        "AWS_CONFIG_FILE": str(workdir / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(workdir / "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "GPUCLOUD_STORAGE_CACHE": str(workdir / "storage-cache"),
    }
    try:
        _wait_ready(proc, endpoint, log)
        with pytest.MonkeyPatch.context() as mp:
            for key, value in env.items():
                mp.setenv(key, value)
            yield S3Server(endpoint, env)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(proc: subprocess.Popen, endpoint: str, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"moto exited with {proc.returncode}:\n{log.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(endpoint, timeout=1)
            return
        time.sleep(0.1)
    raise AssertionError(f"moto did not answer at {endpoint}:\n{log.read_text()}")


def env_without(*keys: str, **extra: str) -> dict[str, str]:
    """This process's environment minus `keys`, plus `extra` (for a subprocess)."""
    env = {k: v for k, v in os.environ.items() if k not in keys}
    return env | extra
