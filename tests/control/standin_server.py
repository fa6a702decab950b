"""A stand-in model server for deployment tests: answers GET /ready with its pid.

`gpucloud serve` is what deployments run by default; this keeps the control-plane tests
independent of the serving engine.  python standin_server.py PORT
"""

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"pid": os.getpid(), "path": self.path}).encode()
        self.send_response(200 if self.path == "/ready" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
