"""The HTTP transport: stdlib ThreadingHTTPServer, one thread per connection, JSON in and out.

Routes (SGLang 0.5.13.post1 names): GET /health, /health_generate, /model_info, /get_model_info,
/server_info, /get_server_info, /metrics (with --enable-metrics); POST|PUT /generate.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .api import BadRequest, EngineApi, Unavailable

logger = logging.getLogger("ddtree_lab_engine")


def _json_default(value: Any) -> Any:
    # ServerArgs carries enums, sets and paths here and there; SGLang's orjson response
    # serialises them as their values / lists / strings.
    if hasattr(value, "value"):
        return value.value
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, default=_json_default).encode()


class _Handler(BaseHTTPRequestHandler):
    server: EngineHTTPServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s - %s", self.address_string(), format % args)

    def _send(self, status: int, body: bytes = b"", content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._send(status, dumps({"error": {"message": message}}))

    def _unauthorized(self, path: str) -> bool:
        if self.server.api.authorized(path, self.headers.get("Authorization")):
            return False
        self._send(401, dumps({"error": "Unauthorized"}))
        return True

    def _drip(self, body: bytes) -> None:
        """faults.LIE drip: a reply that never finishes, one byte every half second."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body) * 1000))
        self.end_headers()
        try:
            while True:
                for byte in body:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.5)
        except OSError:
            return

    def do_GET(self) -> None:
        api = self.server.api
        path = self.path.split("?", 1)[0]
        if self._unauthorized(path):
            return
        if path in ("/health", "/health_generate"):
            self._send(api.health(path))
        elif path in ("/model_info", "/get_model_info"):
            self._send(200, dumps(api.model_info()))
        elif path in ("/server_info", "/get_server_info"):
            self._send(200, dumps(api.server_info()))
        elif path == "/metrics" and api.server_args.enable_metrics:
            self._send(200, api.metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/generate":
            self._error(405, "Method Not Allowed")
        else:
            self._send(404, dumps({"detail": "Not Found"}))

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if self._unauthorized(path):
            return
        if path != "/generate":
            self._send(404, dumps({"detail": "Not Found"}))
            return
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"null")
        except ValueError as e:
            self._error(400, f"invalid JSON: {e}")
            return
        with self.server.track():
            try:
                answer = dumps(self.server.api.generate(body))
                if self.server.api.lie == "drip":
                    self._drip(answer)
                    return
                self._send(200, answer)
            except BadRequest as e:
                self._error(400, str(e))
            except Unavailable as e:
                self._error(503, str(e))

    do_PUT = do_POST


class EngineHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], api: EngineApi) -> None:
        super().__init__(address, _Handler)
        self.api = api
        self._inflight = 0
        self._cv = threading.Condition()

    def track(self) -> _Inflight:
        return _Inflight(self)

    def wait_idle(self, timeout_s: float) -> bool:
        """True once no /generate is being answered (their responses are written) within timeout_s."""
        with self._cv:
            return self._cv.wait_for(lambda: self._inflight == 0, timeout_s)


class _Inflight:
    def __init__(self, server: EngineHTTPServer) -> None:
        self.server = server

    def __enter__(self) -> None:
        with self.server._cv:
            self.server._inflight += 1

    def __exit__(self, *exc: object) -> None:
        with self.server._cv:
            self.server._inflight -= 1
            self.server._cv.notify_all()
