"""A replica for the console's traffic charts: tests/control/fake_replica.py's stand-in
(a completion "ok" at once; a 500 when the prompt says "fail"), that also exports the
engine's TTFT and TPOT histograms on /metrics under gpucloud/serve/api/metrics.py's
names: each answer observes a TTFT of 30 ms and a TPOT of 4 ms."""

SCRIPT = """
import http.server, json, sys

ANSWERED = [0]
HISTOGRAMS = {"time_to_first_token": (0.03, (0.025, 0.05, 0.1)),
              "time_per_output_token": (0.004, (0.0025, 0.005, 0.01))}

def metrics():
    n, lines = ANSWERED[0], []
    for name, (seen, bounds) in HISTOGRAMS.items():
        full = "gpucloud_serve_" + name + "_seconds"
        lines.append("# TYPE " + full + " histogram")
        for le in (*bounds, "+Inf"):
            count = n if le == "+Inf" or seen <= le else 0
            lines.append(full + '_bucket{le="' + str(le) + '",model_name="m"} ' + str(count))
        lines.append(full + '_count{model_name="m"} ' + str(n))
        lines.append(full + '_sum{model_name="m"} ' + str(n * seen))
    return ("\\n".join(lines) + "\\n").encode()

class Answer(http.server.BaseHTTPRequestHandler):
    def _send(self, status, data, kind):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/metrics":
            self._send(200, metrics(), "text/plain; version=0.0.4")
        else:
            self._send(200, b'{"status": "ok"}', "application/json")

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if b"fail" in body:
            self._send(500, b'{"error": {"message": "failed"}}', "application/json")
            return
        ANSWERED[0] += 1
        answer = {"id": "cmpl-1", "object": "text_completion", "model": "m",
                  "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        self._send(200, json.dumps(answer).encode(), "application/json")

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Answer).serve_forever()
"""
