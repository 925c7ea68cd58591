"""A small HTTP server on its own thread: ``GET /health`` and ``GET /metrics``, nothing else.

``/health`` answers 200 with ``{"status": "ready"}`` while the process's health check says it is ready, else 503 with
``{"status": "not ready", "reason": ...}``, either with what the process says about itself (a worker: the devices its target
runs on); ``/metrics`` answers the process's metrics in Prometheus' text format. The
check and the metrics run on this server's thread: they read what the process's own loop has published, never its
sockets.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from draftfeed.schemas.errors import UsageError

log = logging.getLogger("draftfeed.observe")

# What a health check returns: None when ready, else why not.
HealthCheck = Callable[[], str | None]
# What a process says about itself in every /health answer.
About = Callable[[], dict]
# Where the metrics are: a registry, or nothing yet (a worker still loading its engine).
Registry = Callable[[], CollectorRegistry | None]


class ObserveServer:
    """Serves ``/health`` and ``/metrics`` on ``host:port`` until ``close()``."""

    def __init__(self, host: str, port: int, health: HealthCheck, registry: Registry, flag: str = "--http-port", about: About = dict) -> None:
        handler = _handler(health, registry, about)
        try:
            self._server = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise UsageError(
                f"cannot serve health and metrics on {host}:{port} ({flag}): {exc.strerror}; choose another port, or 0 to turn it off"
            ) from None
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="draftfeed-http", daemon=True)
        self._thread.start()
        log.info("health on http://%s:%d/health, metrics on http://%s:%d/metrics", host, self.port, host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(health: HealthCheck, registry: Registry, about: About) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/health":
                try:
                    reason = health()
                except Exception as exc:  # a failing check reports it, never the server's thread
                    reason = f"the health check failed: {exc}"
                body = {"status": "ready"} if reason is None else {"status": "not ready", "reason": reason}
                body |= about()
                self._answer(200 if reason is None else 503, "application/json", json.dumps(body).encode())
            elif path == "/metrics":
                current = registry()
                self._answer(200, CONTENT_TYPE_LATEST, generate_latest(current) if current is not None else b"")
            else:
                self._answer(404, "text/plain", b"draftfeed serves /health and /metrics\n")

        def _answer(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("http: " + format, *args)

    return Handler
