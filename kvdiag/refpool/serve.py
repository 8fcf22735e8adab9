"""Serve a simulated engine's exposition over HTTP on loopback, like the engine's /metrics.

The body is rendered on every request from a callable, so whatever drives the simulated
engine (a script, the discrete-event simulator) is what a scraper sees at that moment.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

Render = Callable[[bool], tuple[str, str]]  # (wants OpenMetrics) -> (body, content type)


class MetricsServer:
    """A threaded HTTP server answering ``GET /metrics`` with ``render``'s current body."""

    def __init__(self, render: Render, host: str = "127.0.0.1", port: int = 0) -> None:
        self.render = render
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                if self.path.split("?")[0].rstrip("/") != "/metrics":
                    self.send_error(404)
                    return
                wants_om = "application/openmetrics-text" in self.headers.get("Accept", "")
                body, ctype = outer.render(wants_om)
                data = body.encode()
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the scraper hung up (its timeout ran out while the simulator held the lock)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "MetricsServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
