"""The reaper's HTTP endpoints on one port: /metrics (the default registry, harvester.metrics),
/healthz (the process is alive) and /readyz (the database and Kafka are reachable, as the caller's
check says). Failures are structlog events, never plain text on stderr.
"""

from __future__ import annotations

import errno
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from harvester import logs

# A scrape that timed out or a probe that hung up: the client is gone, the process is fine.
_CLIENT_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A request's failure as a structlog event (socketserver's default prints a plain-text
        traceback on stderr, between the JSON lines)."""
        exc = sys.exc_info()[1]
        log = logs.get("reaper.http")
        if isinstance(exc, _CLIENT_GONE):
            log.info("metrics client went away before its answer", error=type(exc).__name__)
        else:
            log.error("metrics request failed", exc_info=True)


class CannotListen(RuntimeError):
    """The metrics server could not bind metrics.host:metrics.port (taken, or not an address here)."""

    def __init__(self, host: str, port: int, exc: OSError) -> None:
        if exc.errno == errno.EADDRINUSE:
            why = f"metrics.port {port} is in use on {host} (is metrics.port free?)"
        else:
            why = f"cannot listen on metrics.host {host}, metrics.port {port}: {exc.strerror or exc}"
        super().__init__(f"the metrics server did not start: {why}")


class HealthServer:
    """/metrics, /healthz (process alive) and /readyz (database and Kafka reachable) on one port."""

    def __init__(self, host: str, port: int, ready: Callable[[], tuple[bool, str]]) -> None:
        check = ready

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._send(200, b"ok\n")
                elif path == "/readyz":
                    ok, why = check()
                    self._send(200 if ok else 503, (why + "\n").encode())
                else:
                    self._send(404, b"not found\n")

            def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # quiet: scrapes are not news
                pass

        try:
            self.httpd = _Server((host, port), Handler)
        except OSError as exc:  # named as the console's port is: the key, the address and why
            raise CannotListen(host, port, exc) from None
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="reaper-http", daemon=True)

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
