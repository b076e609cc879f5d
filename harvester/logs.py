"""structlog setup: JSON lines by default, readable console output in a terminal or on request.

Every event carries the leader id of its own harvest unit (None while it follows): see `unit_leaders`.
Nothing else reaches stderr raw: `configure` also routes the standard library's logging (psycopg
pool, confluent-kafka clients given a `logging.Logger`, e.g. the tracker's acker), Python
warnings, uncaught thread exceptions and exceptions that cannot be raised (in a __del__) into
structlog. librdkafka's own lines come through each
client's `logger` setting (`KafkaLogger` here, a `logging.Logger` named `reaper.kafka.<client>`
in the tracker), so they never bypass the renderer and interleave with JSON lines.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import threading
import time
from collections.abc import Callable

import structlog
from structlog.typing import EventDict, WrappedLogger


class _UnitLeaders:
    """The id each harvest unit marks rows with now (None while it does not lead), by unit name.

    A log line carries its own unit's: the unit comes from the line (`unit=`, a name or a
    leader-topic partition) or from the thread it is logged on (`unit_thread` binds it for every
    thread a unit starts); a line of no unit carries the id only when the process has one unit.
    A line that names its unit by leader-topic partition (the election's) is given the unit's name
    (`unit`) and keeps the partition (`leader_partition`); a line that names the unit's leadership
    by its acquisition id (the election's) carries the id the unit marks with now, the acquisition's
    own until a remark takes a new one (see MarkingLoop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[str, str | None] = {}
        self._names: dict[int, str] = {}  # leader-topic partition -> unit name
        self._acquired: dict[str, str] = {}  # unit name -> the acquisition its id derives from

    def set(
        self, unit: str, leader_id: object | None, index: int | None = None, acquisition: object | None = None
    ) -> None:
        with self._lock:
            self._ids[unit] = None if leader_id is None else str(leader_id)
            if index is not None:
                self._names[index] = unit
            if leader_id is None:
                self._acquired.pop(unit, None)
            elif acquisition is not None:
                self._acquired[unit] = str(acquisition)

    def forget(self, unit: str) -> None:
        with self._lock:
            self._ids.pop(unit, None)
            self._acquired.pop(unit, None)
            self._names = {i: n for i, n in self._names.items() if n != unit}

    def of(self, unit: object) -> str | None:
        with self._lock:
            if unit is None:
                return next(iter(self._ids.values())) if len(self._ids) == 1 else None
            name = self._names.get(unit) if isinstance(unit, int) else unit
            return self._ids.get(name) if isinstance(name, str) else None

    def name(self, unit: object) -> str | None:
        """The name of the unit of leader-topic partition `unit` (None: not a unit of this process)."""
        if not isinstance(unit, int) or isinstance(unit, bool):
            return None
        with self._lock:
            return self._names.get(unit)

    def marking(self, unit: object, leader_id: object) -> object:
        """`leader_id` as a line of `unit` names it: the unit's id now when it names the acquisition
        that id derives from, else as it is."""
        if not isinstance(unit, str) or leader_id is None:
            return leader_id
        with self._lock:
            now = self._ids.get(unit)
            return now if now is not None and self._acquired.get(unit) == str(leader_id) else leader_id


unit_leaders = _UnitLeaders()


def _add_leader_id(_logger: WrappedLogger, _name: str, event: EventDict) -> EventDict:
    name = unit_leaders.name(event.get("unit"))
    if name is not None:  # a leader-topic partition: the unit's name, the partition kept
        event.setdefault("leader_partition", event["unit"])
        event["unit"] = name
    if "leader_id" not in event:
        event["leader_id"] = unit_leaders.of(event.get("unit"))
    else:
        event["leader_id"] = unit_leaders.marking(event.get("unit"), event["leader_id"])
    return event


def unit_thread(target: Callable[..., object], name: str, args: tuple = ()) -> threading.Thread:
    """A daemon thread running `target` in a copy of the caller's context: the structlog context
    variables bound where it is made (a unit's name, see UnitHarvester) tag its lines too."""
    return threading.Thread(target=contextvars.copy_context().run, args=(target, *args), name=name, daemon=True)


# librdkafka facilities of connection trouble (the line's first word), and what an ERROR line
# says when it is about connections rather than anything else.
_TROUBLE_FACILITIES = frozenset({"FAIL", "REQTMOUT", "BROKERFAIL"})
_TROUBLE_TEXT = ("brokers are down", "Connect to ", "Connection refused", "transport failure", "Disconnected")
QUIET_AFTER = 5.0  # seconds without a failure (at least twice the longest gap seen) before "back"


def _broker_of(text: str) -> str:
    """The broker a librdkafka line is about: its thread's name without the node id
    ("[thrd:127.0.0.1:9092/1]" -> "127.0.0.1:9092"), "*" for the application's or main thread."""
    _, sep, rest = text.partition("[thrd:")
    name = rest.split("]", 1)[0] if sep else ""
    if not name or name in ("app", "main"):
        return "*"  # about the whole cluster
    if "/" not in name:
        return name  # a logical broker (GroupCoordinator, TxnCoordinator)
    name = name.rsplit("/", 1)[0]
    return name.split("://", 1)[-1]


class _Away:
    __slots__ = ("since", "last", "gap", "suppressed")

    def __init__(self, now: float) -> None:
        self.since = self.last = now
        self.gap = 0.0  # the longest time between two failures seen (librdkafka backs off)
        self.suppressed = 0


class ConnectionChatter:
    """One client's connection trouble, one line per broker outage.

    While a broker is away, librdkafka logs every failed attempt (every reconnect back-off, down to
    ~25 ms while all brokers are down): hundreds of error lines a minute that page people for a
    restart. Here the first failure of a broker is one warning; the next ones are counted, not
    logged; once none has come for QUIET_AFTER seconds (and twice the longest gap between
    failures, so a growing back-off is not taken for a return) one info line says so, with the
    count. librdkafka logs nothing when a connection succeeds, so the return is read from the
    failures stopping."""

    def __init__(self, client: str) -> None:
        self.client = client
        self._log = get("reaper.kafka").bind(client=client)
        self._lock = threading.Lock()
        self._away: dict[str, _Away] = {}

    @staticmethod
    def is_trouble(text: str) -> bool:
        facility = text.split(" ", 1)[0]
        if facility in _TROUBLE_FACILITIES:
            return True
        return facility == "ERROR" and any(t in text for t in _TROUBLE_TEXT)

    def admit(self, text: str, now: float | None = None) -> bool:
        """True when the trouble line `text` is to be logged (a broker's first): as a warning."""
        now = time.monotonic() if now is None else now
        broker = _broker_of(text)
        with self._lock:
            away = self._away.get(broker)
            if away is None:
                self._away[broker] = _Away(now)
                first = True
            else:
                away.gap = max(away.gap, now - away.last)
                away.last = now
                away.suppressed += 1
                first = False
        if first:
            _watch(self)
        return first

    def tick(self, now: float | None = None) -> bool:
        """Report the brokers whose failures stopped; True while any is still away."""
        now = time.monotonic() if now is None else now
        back = []
        with self._lock:
            for broker, away in list(self._away.items()):
                if now - away.last >= max(QUIET_AFTER, 2 * away.gap):
                    back.append((broker, away))
                    del self._away[broker]
            left = bool(self._away)
        for broker, away in back:
            self._log.info(
                "Kafka connection failures stopped",
                broker=broker,
                failures_not_logged=away.suppressed,
                seconds=round(away.last - away.since, 1),
            )
        return left


_chatter: dict[str, ConnectionChatter] = {}
_watched: set[ConnectionChatter] = set()
_chatter_lock = threading.Lock()
_watcher: threading.Thread | None = None


def chatter(client: str) -> ConnectionChatter:
    """The one ConnectionChatter of clients named `client` (every client of that name shares it)."""
    with _chatter_lock:
        return _chatter.setdefault(client, ConnectionChatter(client))


def _watch(gate: ConnectionChatter) -> None:
    global _watcher
    with _chatter_lock:
        _watched.add(gate)
        if _watcher is None or not _watcher.is_alive():
            _watcher = threading.Thread(target=_watch_loop, name="reaper-kafka-chatter", daemon=True)
            _watcher.start()


def _watch_loop() -> None:
    while True:
        time.sleep(0.5)
        with _chatter_lock:
            gates = list(_watched)
        for gate in gates:
            if not gate.tick():
                with _chatter_lock:
                    _watched.discard(gate)


class _ToStructlog(logging.Handler):
    """Standard-library log records as structlog events (the bridge for libraries and the tracker)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            fields: dict = {"exc_info": record.exc_info} if record.exc_info else {}
            if record.name.startswith("reaper.kafka."):  # a confluent-kafka client's librdkafka line
                KafkaLogger(record.name[len("reaper.kafka.") :]).emit(record.levelno, text, **fields)
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


def _unraisable(args) -> None:
    # An exception Python cannot raise (in a __del__, a finaliser, a closing generator): its
    # default hook prints a plain-text traceback on stderr.
    get("reaper").error(
        "exception that could not be raised",
        where=repr(args.object) if args.object is not None else None,
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
    sys.unraisablehook = _unraisable


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


class Repeats:
    """Whether a line about a condition that lasts is written now: when what it says is new, and
    again every `every` seconds while it stays the same (its loop retries far more often)."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._last: tuple[str, float] = ("", 0.0)  # the last text written, and when

    def due(self, what: str) -> bool:
        last, at = self._last
        now = time.monotonic()
        if what == last and now - at < self.every:
            return False
        self._last = (what, now)
        return True


class KafkaLogger:
    """librdkafka's log lines (passed as the client's `logger`) turned into structlog events."""

    _QUIET = ("enable.gapless.guarantee is experimental",)  # reaper sets it on purpose

    def __init__(self, client: str) -> None:
        self._log = get("reaper.kafka").bind(client=client)
        self._chatter = chatter(client)

    def log(self, level: int, fmt: str, *args) -> None:
        self.emit(level, fmt % args if args else fmt)

    def emit(self, level: int, text: str, **fields) -> None:
        if any(q in text for q in self._QUIET):
            return
        if level >= logging.WARNING and ConnectionChatter.is_trouble(text):
            # A broker away is news once (a warning), not an error per reconnect attempt.
            if self._chatter.admit(text):
                self._log.warning("librdkafka", message=text, broker=_broker_of(text), **fields)
            return
        if level >= logging.ERROR:
            self._log.error("librdkafka", message=text, **fields)
        elif level >= logging.WARNING:
            self._log.warning("librdkafka", message=text, **fields)
        else:
            self._log.debug("librdkafka", message=text, **fields)
