"""harvester.logs configured onto a buffer for one test, the process's logging restored afterwards."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import logging
import sys
import threading
from collections.abc import Iterator

import structlog

from harvester import logs


@contextlib.contextmanager
def json_log() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved = (structlog.get_config(), list(root.handlers), root.level, threading.excepthook, sys.unraisablehook)
    out = io.StringIO()
    logs.configure("json", "info", stream=out)
    try:
        yield out
    finally:
        config, handlers, level, hook, unraisable = saved
        structlog.configure(**config)
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.captureWarnings(False)
        threading.excepthook = hook
        sys.unraisablehook = unraisable


def events(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]


def unix_time(iso_timestamp: str) -> float:
    """A log line's `timestamp` (structlog's ISO format, UTC) as unix time."""
    return dt.datetime.fromisoformat(iso_timestamp.replace("Z", "+00:00")).timestamp()
