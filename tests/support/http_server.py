"""A real uvicorn server running the HTTP app on a free loopback port, in a thread of the test."""

from __future__ import annotations

import threading
import time

import uvicorn

from harvester import config as config_mod
from harvester.services.http.app import create_app
from harvester.services.http.deadlines import DeadlineProtocol

TOKEN = "test-token-0123456789abcdef"
OTHER_TOKEN = "other-token-0123456789abcdef"


class RunningServer:
    def __init__(self, cfg: config_mod.Config, tokens: list[str]) -> None:
        self.app = create_app(cfg, tokens=tokens)
        h = cfg.http
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host="127.0.0.1",
                port=0,
                lifespan="on",
                access_log=False,
                log_config=None,
                http=DeadlineProtocol.with_timeouts(h.header_timeout, h.body_timeout),  # as `reaper serve`
            )
        )
        self.thread = threading.Thread(target=self.server.run, name="http-test-server", daemon=True)

    def __enter__(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def http_config(dsn: str, schema: str, **http: object) -> config_mod.Config:
    return config_mod.load(
        environ={},
        overrides={"database": {"dsn": dsn, "schema": schema}, "http": http, "logging": {"level": "warning"}},
    )
