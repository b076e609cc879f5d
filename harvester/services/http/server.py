"""`reaper serve`: uvicorn running the HTTP app, TLS if configured, graceful shutdown on SIGTERM.

On SIGTERM/SIGINT the server stops accepting connections, /readyz turns 503, long-polls answer at
once with the batch's current state, in-flight requests get up to http.shutdown_timeout seconds,
then the database pool closes.
"""

from __future__ import annotations

import asyncio
import functools
import signal
import socket
from collections.abc import Callable

import uvicorn

from harvester.config import Config
from harvester.exit_codes import ExitCode
from harvester.services.http.app import create_app
from harvester.services.http.deadlines import DeadlineProtocol
from harvester.services.http.security import check_startup, load_tokens


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self.on_hup: Callable[[], None] | None = None
        self.handshake_timeout = 60.0  # a TLS handshake's bound, seconds (build: http.header_timeout)

    async def serve(self, sockets=None) -> None:  # noqa: ANN001 (uvicorn's signature)
        if self.on_hup is not None:
            # SIGHUP as an event loop callback, its work on a worker thread: not inside the signal
            # handler, where logging (or any lock the interrupted code holds) could deadlock.
            loop = asyncio.get_running_loop()
            on_hup = self.on_hup
            loop.add_signal_handler(signal.SIGHUP, lambda: loop.run_in_executor(None, on_hup))
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # With TLS, the app's protocol (and its header_timeout) sees a connection only once its
        # handshake is done; the handshake gets the same bound (asyncio's default is 60 s), passed
        # to the loop's create_server, which uvicorn calls without it.
        if self.config.ssl is None:
            await super().startup(sockets)
            return
        loop = asyncio.get_running_loop()
        timeout = self.handshake_timeout
        loop.create_server = functools.partial(loop.create_server, ssl_handshake_timeout=timeout)  # type: ignore[method-assign]
        try:
            await super().startup(sockets)
        finally:
            del loop.create_server  # the loop's own method again

    def handle_exit(self, sig, frame) -> None:  # noqa: ANN001 (uvicorn's signature)
        # Drain, then stop as uvicorn does, but without recording the signal: uvicorn would raise
        # it again after a clean shutdown, and `reaper serve` should then exit 0.
        self._on_exit()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


def build(cfg: Config) -> tuple[uvicorn.Server, object]:
    """The configured server and its ASGI app; raises ConfigError (no tokens, bad TLS files...)."""
    h = cfg.http
    tokens = load_tokens(h)
    check_startup(h, tokens)
    app = create_app(cfg, tokens=tokens)
    fastapi_app = app.fastapi

    def drain() -> None:
        fastapi_app.state.draining = True
        fastapi_app.state.watcher.release_all()

    config = uvicorn.Config(
        app,
        host=h.host,
        port=h.port,
        lifespan="on",
        access_log=False,
        log_config=None,
        server_header=False,
        proxy_headers=True,
        forwarded_allow_ips=h.forwarded_allow_ips,
        timeout_graceful_shutdown=h.shutdown_timeout,  # type: ignore[arg-type]  # uvicorn waits with a float
        ssl_certfile=h.tls_certfile or None,
        ssl_keyfile=h.tls_keyfile or None,
        h11_max_incomplete_event_size=64 * 1024,
        http=DeadlineProtocol.with_timeouts(h.header_timeout, h.body_timeout),
        loop="asyncio",  # startup() passes the TLS handshake's bound to this loop's create_server
    )
    server = _DrainingServer(config, drain)
    server.handshake_timeout = h.header_timeout
    return server, app


def serve(cfg: Config) -> int:
    server, app = build(cfg)
    auth = app.fastapi.state.auth  # type: ignore[attr-defined]
    # SIGHUP re-reads http.tenants_file (it is also re-read when it changes): tokens added or revoked
    server.on_hup = auth.reload  # type: ignore[attr-defined]
    server.run()
    return ExitCode.OK if server.started else ExitCode.FAILURE
