#!/usr/bin/env python3
"""HTTP peer for client-bench's --sweep-config test (not the server under test).

Started as `<script> serve --config PATH --port 0`, like `npu-serving serve`. It prints
`listening on 127.0.0.1:PORT`, answers GET /health, and streams llm-serving style lines whose
text names the config's model_config.decode_batch_size, so the test can see which config each
process got. With decode_batch_size below 8 every generation request gets HTTP 503, so the
sweep's best setting is known without any timing. Exits cleanly on SIGTERM.
"""
import json
import re
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main():
    argv = sys.argv[1:]
    if len(argv) < 5 or argv[0] != "serve" or argv[1] != "--config" or argv[3] != "--port":
        print("usage: serve --config PATH --port N", file=sys.stderr)
        return 2
    with open(argv[2]) as f:
        config = f.read()
    m = re.search(r"decode_batch_size:\s*(\d+)", config)
    batch = int(m.group(1)) if m else 0

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args):
            pass

        def reply(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self.reply(200, {"status": "ok"})
            else:
                self.reply(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if batch < 8:
                self.reply(503, {"error": f"decode_batch_size {batch} refused"})
                return
            n = int(body["parameters"]["max_new_tokens"])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for _ in range(n):
                line = {"event": "message", "retry": 30000,
                        "data": [{"generated_text": f" bs{batch}"}]}
                self.wfile.write((json.dumps(line) + "\n").encode())
                self.wfile.flush()

    server = ThreadingHTTPServer(("127.0.0.1", int(argv[4])), Handler)
    signal.signal(signal.SIGTERM,
                  lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"starting with decode_batch_size={batch}", flush=True)
    print(f"listening on 127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
