"""A local JSON-over-HTTP stand-in for the SGLang endpoints the bench clients call (/health,
/server_info, /generate), for tests of bench/gpu's clients without a GPU server."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JSONHandler(BaseHTTPRequestHandler):
    """Quiet; `send_json` writes one JSON reply. Subclasses define do_GET / do_POST."""

    def log_message(self, *_a) -> None:
        pass

    def send_json(self, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def read_json(self):
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))


class _Server(ThreadingHTTPServer):
    request_queue_size = 128  # bs 32 connects at once; the default backlog of 5 resets some
    daemon_threads = True


def serve(handler: type[JSONHandler]) -> ThreadingHTTPServer:
    """Start `handler` on a free local port in a daemon thread; `.shutdown()` stops it."""
    srv = _Server(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv
