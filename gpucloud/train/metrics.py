"""Rank 0's view of a run: `metrics.jsonl` and a Prometheus text endpoint.

Each logged step is one JSON object per line (`step`, `loss`, `grad_norm`, `lr`,
`tokens_per_s`, `step_time_s`, `data_time_s`, `sync_time_s`, `eta_s`, `mfu`,
`memory_bytes`, ...), appended and flushed
at once so whoever follows the file sees it (the launcher's console progress, a control
plane). Events (skip, rollback, resume, stop) are lines with an `event` key. The endpoint
serves the latest value of each numeric field.
"""

from __future__ import annotations

import json
import math
import resource
import threading
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
PORT_FILE = "metrics_port"


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float | None, devices: int):
    """Model FLOPs utilization in [0, 1], or None when the device's peak is unknown."""
    if not peak_flops:
        return None
    return tokens_per_s * flops_per_token / (peak_flops * devices)


def memory_bytes(backend_name: str, index: int) -> int | None:
    """Device memory in use on an accelerator, or this process's peak RSS on the host."""
    if backend_name == "cpu":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    from gpucloud.hal import device

    info = device.memory_info(index, device.get_backend(backend_name))
    if info.total_bytes is None or info.free_bytes is None:
        return None
    return info.total_bytes - info.free_bytes


def _clean(value: Any) -> Any:
    # JSON has no NaN: a non-finite number is written as null (the event says why).
    return None if isinstance(value, float) and not math.isfinite(value) else value


class MetricsLog:
    """Writes records on rank 0; every other rank gets a no-op instance."""

    def __init__(self, run_dir: Path, enabled: bool, port: int | None = None):
        self.enabled = enabled
        self.latest: dict[str, float] = {}
        self._file = (run_dir / METRICS_FILE).open("a") if enabled else None
        self._server = _serve(self, run_dir, port) if enabled and port is not None else None

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {k: _clean(v) for k, v in record.items()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for key, value in record.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.latest[key] = value

    def prometheus_text(self) -> str:
        lines = []
        for key, value in sorted(self.latest.items()):
            name = f"gpucloud_train_{key}"
            lines += [f"# TYPE {name} gauge", f"{name} {value}"]
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def _serve(log: MetricsLog, run_dir: Path, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path != "/metrics":
                self.send_error(404)
                return
            body = log.prometheus_text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # quiet: scrapes are not news
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    (run_dir / PORT_FILE).write_text(f"{server.server_address[1]}\n")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class StepClock:
    """Seconds left in a run, from the mean duration of its last `window` steps (the first,
    slow steps of an attempt fade out of the estimate)."""

    def __init__(self, window: int = 20):
        self.recent: deque[float] = deque(maxlen=window)

    def add(self, seconds: float) -> None:
        self.recent.append(seconds)

    def seconds_left(self, steps_left: int) -> float:
        return sum(self.recent) / len(self.recent) * steps_left if self.recent else 0.0


class MetricsFollower:
    """The records appended to a `metrics.jsonl` from now on, as rank 0 writes them.

    Starts at the file's current end (a resumed run's earlier records are not news) and
    keeps a line that is still being written for the next call.
    """

    def __init__(self, path: Path):
        self.path = path
        self.offset = path.stat().st_size if path.is_file() else 0
        self.partial = b""

    def new_records(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        return [json.loads(line) for line in lines if line]
