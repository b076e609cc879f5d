"""What `reaper run` checks before it starts anything, and what its /readyz asks while it runs.

At start: the database answers and holds the outbox table (else `reaper migrate` first, or for a
table of the application's own, CREATE TABLE: `missing_table` says which), and Kafka
answers; a check that fails for a reason that may pass is tried again until
database.startup_timeout. A DSN libpq refuses before connecting is a ConfigError at once. /readyz: both answered within a second or two (cached for a second).
"""

from __future__ import annotations

import threading
import time

import psycopg
from confluent_kafka.admin import AdminClient

from harvester import logs
from harvester.config import Config, ConfigError, redact_dsn
from harvester.dsn_options import dsn_refusal
from harvester.election.timeouts import silent_broker_wait_ms, socket_waits
from harvester.publishing.publisher import logs_safe
from tracker.schema import missing_table, qualified  # (the tracker says it too, of a missing outbox table)


class Unavailable(RuntimeError):
    """A start-up check failed. `lasting`: waiting will not help (a schema that is not migrated):
    `reaper run` exits at once, without waiting out database.startup_timeout. Every failure to
    connect is waited for: libpq gives no SQLSTATE for one, so a refused login cannot be told from
    a server that is still starting, except by its (localised) message."""

    def __init__(self, message: str, *, lasting: bool = False) -> None:
        super().__init__(message)
        self.lasting = lasting


def _check_database(cfg: Config, connect_timeout: int = 10) -> None:
    try:
        with psycopg.connect(cfg.database.dsn, connect_timeout=connect_timeout) as conn:
            row = conn.execute(
                "SELECT to_regclass(%s)", [qualified(cfg.database.schema, cfg.database.outbox_table).as_string(conn)]
            ).fetchone()
            assert row is not None  # a SELECT without FROM returns exactly one row
            found = row[0]
    except psycopg.Error as exc:
        refused = dsn_refusal(cfg.database.dsn)  # a mistake in the DSN itself: retrying cannot help
        if refused is not None:
            raise refused from None
        raise Unavailable(f"database unreachable: {logs_safe(exc)}") from None
    if found is None:
        raise Unavailable(missing_table(cfg.database.schema, cfg.database.outbox_table), lasting=True)


def admin_client(cfg: Config) -> AdminClient:
    """The start-up checks' and /readyz's client. A broker that answers nothing is given up as the
    election's clients give it up (kafka.client overrides): at librdkafka's 60 s socket timeout its
    metadata requests kept going to a silent broker (librdkafka prefers the one it used last), and
    /readyz said Kafka was unreachable for up to a minute while the other brokers answered."""
    wait = silent_broker_wait_ms(cfg.harvester.heartbeat_timeout, cfg.harvester.session_timeout)
    conf = {
        "bootstrap.servers": cfg.kafka.bootstrap_servers,
        **socket_waits(wait),
        **cfg.kafka.client,
        "logger": logs.KafkaLogger("admin"),
    }
    return AdminClient(conf)


def _check_kafka(admin: AdminClient, timeout: float = 15.0) -> None:
    try:
        admin.list_topics(timeout=timeout)
    except Exception as exc:
        raise Unavailable(f"Kafka unreachable at the configured bootstrap servers: {exc}") from None
    finally:
        admin.poll(0)  # an admin client's log lines wait for a poll: hand them to structlog


# Start-up checks that fail for a reason that may pass (no primary yet, Kafka not up) are tried
# again after a pause that doubles from the first to the last, until database.startup_timeout.
STARTUP_RETRY_FIRST, STARTUP_RETRY_MAX = 0.5, 5.0


def _check_once(
    cfg: Config, admin: AdminClient, term: threading.Event, remaining: float | None
) -> BaseException | None:
    """One round of the start-up checks (None: passed), in a thread of its own so that a signal
    (`term`) ends the wait at once, even inside a connect. `remaining`: seconds left to wait (each
    check's own timeout is cut to it); None: no wait, the checks' full timeouts."""
    db_timeout = 10 if remaining is None else int(min(10, max(2, remaining)))
    kafka_timeout = 15.0 if remaining is None else min(15.0, max(2.0, remaining))
    outcome: list[BaseException | None] = []

    def check() -> None:
        try:
            _check_database(cfg, db_timeout)
            _check_kafka(admin, kafka_timeout)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=check, name="reaper-startup-check", daemon=True)
    t.start()
    while t.is_alive() and not term.is_set():
        t.join(0.1)
    if not outcome:  # stopped by a signal while a check was under way: it is left behind
        return Unavailable("stopped by a signal during the start-up checks", lasting=True)
    return outcome[0]


def await_services(cfg: Config, admin: AdminClient, term: threading.Event) -> bool:
    """The start-up checks, tried again with a growing pause while they fail for a reason that may
    pass, for up to database.startup_timeout seconds (0: once). One log line per distinct reason;
    a signal (`term`) ends the wait. False: the reaper cannot start (logged). Raises ConfigError
    for a DSN libpq refuses (harvester.dsn_options), at once."""
    log = logs.get("reaper")
    wait = cfg.database.startup_timeout
    started = time.monotonic()
    deadline = started + wait
    pause = STARTUP_RETRY_FIRST
    seen: set[str] = set()
    while True:
        exc = _check_once(cfg, admin, term, max(0.0, deadline - time.monotonic()) if wait > 0 else None)
        if exc is None:
            if seen:
                log.info("database and Kafka available", waited=round(time.monotonic() - started, 3))
            return True
        if isinstance(exc, ConfigError):  # a DSN libpq refuses: `reaper run` reports it and exits 2
            raise exc
        reason = redact_dsn(str(exc)) if isinstance(exc, Unavailable) else logs_safe(exc)
        lasting = not isinstance(exc, Unavailable) or exc.lasting
        left = deadline - time.monotonic()
        if term.is_set():
            log.error("cannot start: stopped by a signal while waiting", error=reason)
            return False
        if lasting or left <= 0:
            log.error("cannot start", error=reason, waited=round(time.monotonic() - started, 3))
            return False
        if reason not in seen:
            seen.add(reason)
            log.warning("waiting for the database and Kafka", error=reason, timeout=wait)
        if term.wait(min(pause, left)):
            log.error("cannot start: stopped by a signal while waiting", error=reason)
            return False
        pause = min(pause * 2, STARTUP_RETRY_MAX)


class Readiness:
    """/readyz: database and Kafka answered within a second or two (cached for a second)."""

    def __init__(self, pool, admin: AdminClient) -> None:
        self.pool, self.admin = pool, admin
        self._at, self._last = 0.0, (False, "not checked")
        self._lock = threading.Lock()

    def __call__(self) -> tuple[bool, str]:
        with self._lock:
            if time.monotonic() - self._at < 1.0:
                return self._last
            problems = []
            try:
                with self.pool.connection(timeout=2) as conn:
                    conn.execute("SELECT 1")
            except Exception as exc:
                problems.append(f"database: {type(exc).__name__}")
            try:
                self.admin.list_topics(timeout=2)
            except Exception as exc:
                problems.append(f"kafka: {type(exc).__name__}")
            self.admin.poll(0)  # its queued librdkafka log lines, to structlog
            self._last = (not problems, "; ".join(problems) or "ready")
            self._at = time.monotonic()
            return self._last
