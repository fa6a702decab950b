"""A stand-in model server for deployments whose tests are about the control plane, not
the engine: it answers /ready, /health and any POST (a completion "ok") at once, so its
replica is READY in a moment instead of the tiny model's seconds."""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from pathlib import Path

SCRIPT = """
import http.server, json, sys

class Answer(http.server.BaseHTTPRequestHandler):
    def _json(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._json({"status": "ok"})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._json({"id": "cmpl-1", "object": "text_completion", "model": "fake",
                    "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Answer).serve_forever()
"""


def spec(script: str = SCRIPT) -> dict[str, str]:
    """The `model_dir` and `command` of a deployment that runs the stand-in (`script`,
    which gets its port as its argument). The script is its "model dir", which the
    sandbox shows its replicas: a new dir directly in the temp dir (pytest's own are
    closed to the tenants' users), removed when the tests end."""
    directory = Path(tempfile.mkdtemp(prefix="gpucloud-test-replica-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    directory.chmod(0o755)
    path = directory / "fake_replica.py"
    path.write_text(script)
    path.chmod(0o644)
    command = f"{sys.executable} {{model_dir}}/{path.name} {{port}}"
    return {"model_dir": str(directory), "command": command}
