"""Nothing reaches stderr but structlog's lines: a metrics client that hangs up mid-request (a
scrape that timed out) is one structlog event, not a plain-text traceback from the server thread."""

from __future__ import annotations

import io
import json
import logging
import random
import socket
import struct
import sys
import threading
import time

import pytest
import structlog
from support.harness import wait_until
from support.json_log import json_log as json_log_to_buffer

from harvester import logs
from harvester.health_server import HealthServer


def _hang_up(port: int, rng: random.Random) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + (b"\r\n" if rng.random() < 0.5 else b""))
    time.sleep(rng.random() * 0.01)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    s.close()


@pytest.fixture
def json_log():
    with json_log_to_buffer() as out:
        yield out


def test_a_metrics_client_hanging_up_is_logged_as_json_not_printed(capsys, json_log):
    out = json_log
    server = HealthServer("127.0.0.1", 0, lambda: (True, "ready")).start()
    rng = random.Random(27)
    try:
        for _ in range(40):
            _hang_up(server.port, rng)
        assert wait_until(lambda: "went away" in out.getvalue(), 10), out.getvalue()
    finally:
        server.stop()
    assert capsys.readouterr().err == ""
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    gone = [e for e in events if e["event"] == "metrics client went away before its answer"]
    assert gone and all(e["level"] == "info" for e in gone), events


class _Broken:
    def __del__(self) -> None:
        raise RuntimeError("raised in a finaliser")


def test_thread_and_finaliser_exceptions_are_logged_as_json_not_printed(capsys, json_log):
    def fail() -> None:
        raise ValueError("uncaught in a thread")

    t = threading.Thread(target=fail, name="failing")
    t.start()
    t.join()
    _Broken()  # collected at once: its __del__ raises where nothing can catch it
    assert capsys.readouterr().err == ""
    events = [json.loads(line) for line in json_log.getvalue().splitlines()]
    names = {e["event"] for e in events if e["level"] == "error"}
    assert {"uncaught exception in thread", "exception that could not be raised"} <= names, events
