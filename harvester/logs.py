"""structlog setup: JSON lines by default, readable console output in a terminal or on request.

Every event carries the current leader id (None while following) through `leader_context`.
"""
from __future__ import annotations

import logging
import sys
import threading

import structlog


class _LeaderContext:
    """The leader id the process currently publishes under, shared by all its threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.leader_id: str | None = None

    def set(self, leader_id: object | None) -> None:
        with self._lock:
            self.leader_id = None if leader_id is None else str(leader_id)


leader_context = _LeaderContext()


def _add_leader_id(_logger, _name, event: dict) -> dict:
    event.setdefault("leader_id", leader_context.leader_id)
    return event


def configure(fmt: str = "json", level: str = "info", stream=None) -> None:
    stream = stream or sys.stderr
    console = fmt == "console"
    renderer = structlog.dev.ConsoleRenderer(colors=stream.isatty()) if console else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_leader_id,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


def get(name: str = "reaper"):
    return structlog.get_logger(name)


class KafkaLogger:
    """librdkafka's log lines (passed as the client's `logger`) turned into structlog events."""

    _QUIET = ("enable.gapless.guarantee is experimental",)  # reaper sets it on purpose

    def __init__(self, client: str) -> None:
        self._log = get("reaper.kafka").bind(client=client)

    def log(self, level: int, fmt: str, *args) -> None:
        text = fmt % args if args else fmt
        if any(q in text for q in self._QUIET):
            return
        if level >= logging.ERROR:
            self._log.error("librdkafka", message=text)
        elif level >= logging.WARNING:
            self._log.warning("librdkafka", message=text)
        else:
            self._log.debug("librdkafka", message=text)
