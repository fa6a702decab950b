"""A real `gpucloud serve` process on 127.0.0.1 for the API tests, and small HTTP helpers."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

KV_CACHE_BYTES = 1 << 22  # 4 MiB: thousands of tokens for the tiny model, no memory probing


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, parsed by prometheus_client, by name (and label set)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k != "model_name"}
                key = s.name + ("" if not labels else str(sorted(labels.items())))
                out[key] = s.value
        return out

    def wait_metric(self, name: str, want, timeout: float = 20.0) -> dict[str, float]:
        """Poll /metrics until `want(value)` holds for `name`; returns the last sample set."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if want(m.get(name, 0.0)):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} = {m.get(name)} after {timeout} s")
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, log_dir: Path, *args: str) -> Server:
    """Run `gpucloud serve model_dir --port P args...` and wait for /ready."""
    port = free_port()
    log = log_dir / f"serve-{port}.log"
    cli = [sys.executable, "-c", "from gpucloud.cli.main import app; app()"]
    cmd = [*cli, "serve", str(model_dir), "--port", str(port),
           "--kv-cache-bytes", str(KV_CACHE_BYTES), *args]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{server.url}/ready", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    server.stop()
    raise AssertionError(f"server not ready in time:\n{log.read_text()}")


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    """The response is `status` with OpenAI's error body; returns the error object."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error
