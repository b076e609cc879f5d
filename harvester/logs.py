"""structlog setup: JSON lines by default, readable console output in a terminal or on request.

Every event carries the current leader id (None while following) through `leader_context`.
Nothing else reaches stderr raw: `configure` also routes the standard library's logging (psycopg
pool, confluent-kafka clients given a `logging.Logger`, e.g. the tracker's acker), Python
warnings and uncaught thread exceptions into structlog. librdkafka's own lines come through each
client's `logger` setting (`KafkaLogger` here, a `logging.Logger` named `reaper.kafka.<client>`
in the tracker), so they never bypass the renderer and interleave with JSON lines.
"""

from __future__ import annotations

import logging
import sys
import threading

import structlog
from structlog.typing import EventDict, WrappedLogger


class _LeaderContext:
    """The leader id the process currently publishes under, shared by all its threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.leader_id: str | None = None

    def set(self, leader_id: object | None) -> None:
        with self._lock:
            self.leader_id = None if leader_id is None else str(leader_id)


leader_context = _LeaderContext()


def _add_leader_id(_logger: WrappedLogger, _name: str, event: EventDict) -> EventDict:
    event.setdefault("leader_id", leader_context.leader_id)
    return event


class _ToStructlog(logging.Handler):
    """Standard-library log records as structlog events (the bridge for libraries and the tracker)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            fields: dict = {"exc_info": record.exc_info} if record.exc_info else {}
            if record.name.startswith("reaper.kafka."):  # a confluent-kafka client's librdkafka line
                level = record.levelno if record.levelno >= logging.WARNING else logging.DEBUG  # as KafkaLogger
                get("reaper.kafka").bind(client=record.name[len("reaper.kafka.") :]).log(
                    level, "librdkafka", message=text, **fields
                )
            else:
                get(record.name).log(record.levelno, text, **fields)
        except Exception:  # logging must never raise into the code that logged
            self.handleError(record)


def _thread_exception(args: threading.ExceptHookArgs) -> None:
    get("reaper").error(
        "uncaught exception in thread",
        thread=getattr(args.thread, "name", None),
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )


def _bridge_stdlib(level: str) -> None:
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, _ToStructlog)]:
        root.removeHandler(h)
    root.addHandler(_ToStructlog())
    root.setLevel(getattr(logging, level.upper()))
    logging.captureWarnings(True)
    threading.excepthook = _thread_exception


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
    _bridge_stdlib(level)


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
