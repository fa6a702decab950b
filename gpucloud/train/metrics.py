"""Rank 0's view of a run: `metrics.jsonl`, a Prometheus text endpoint and a progress bar.

Each logged step is one JSON object per line (`step`, `loss`, `grad_norm`, `lr`,
`tokens_per_s`, `step_time_s`, `mfu`, `memory_bytes`, ...), appended and flushed at once
so a control plane tailing the file sees it. Events (skip, rollback, resume, stop) are
lines with an `event` key. The endpoint serves the latest value of each numeric field.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import threading
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

    def __init__(self, run_dir: Path, enabled: bool, max_steps: int, port: int | None = None):
        self.enabled = enabled
        self.latest: dict[str, float] = {}
        self._file = (run_dir / METRICS_FILE).open("a") if enabled else None
        self._server = _serve(self, run_dir, port) if enabled and port is not None else None
        self._progress = _progress(max_steps) if enabled and sys.stderr.isatty() else None

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {k: _clean(v) for k, v in record.items()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for key, value in record.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.latest[key] = value
        if self._progress is not None and "loss" in record:
            bar, task = self._progress
            loss = "-" if record["loss"] is None else f"{record['loss']:.4f}"
            bar.update(task, completed=record["step"], loss=loss)

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
        if self._progress is not None:
            self._progress[0].stop()


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


def _progress(max_steps: int):
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeRemainingColumn(),
        transient=False,
    )
    bar.start()
    return bar, bar.add_task("train", total=max_steps, loss="-")
