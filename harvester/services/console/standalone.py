"""The console served by `reaper run` (console.run: true), on console.host:console.port.

The same pages and the same tokens as under `reaper serve` (http.tokens, http.tokens_file,
http.tenants_file, console.viewer_tokens), in a uvicorn server on a thread of its own; without
tokens only in http.local_mode on a loopback address, as `reaper serve`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from harvester.config import Config
from harvester.services.console.routes import add_console
from harvester.services.console.session import Sessions, load_viewer_tokens
from harvester.services.http.guard import Guard
from harvester.services.http.security import RateLimiter, check_startup, load_tokens
from harvester.services.http.tenants import TenantAuth


def console_app(cfg: Config) -> Guard:
    """The console alone, behind the HTTP service's gate (framing; in local mode, loopback Host names
    only); raises ConfigError as `reaper serve` would (no tokens, bad files)."""
    tokens = load_tokens(cfg.http)
    check_startup(dataclasses.replace(cfg.http, host=cfg.console.host), tokens)
    auth = TenantAuth(tokens, cfg.http.tenants_file, cfg.harvester.default_completion_topic)
    sessions = Sessions(cfg.console, auth, load_viewer_tokens(cfg.console))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(console.open)
        try:
            yield
        finally:
            await asyncio.to_thread(console.close)

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    console = add_console(app, cfg, sessions)
    return Guard(app, auth, RateLimiter(0.0, 1), open_paths=set(), api=False)


class ConsoleServer:
    """uvicorn on a daemon thread; `stop()` lets in-flight requests finish, then returns."""

    def __init__(self, cfg: Config) -> None:
        c = cfg.console
        guard = console_app(cfg)
        self._auth = guard.auth  # its tenants file, re-read by reload_tenants()
        config = uvicorn.Config(
            guard,
            host=c.host,
            port=c.port,
            lifespan="on",
            access_log=False,
            log_config=None,
            server_header=False,
            proxy_headers=True,
            forwarded_allow_ips=cfg.http.forwarded_allow_ips,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="reaper-console", daemon=True)

    def start(self, timeout: float = 30.0) -> ConsoleServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the console did not start (is console.port free?)")
            time.sleep(0.02)
        return self

    def reload_tenants(self) -> bool:
        """Read http.tenants_file again (a bad file keeps the tenants already loaded); False when
        there is no tenants file to read."""
        if not self._auth.file:
            return False
        self._auth.reload()
        return True

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self.thread.ident is not None:  # never started: nothing to join
            self.thread.join(timeout)
