"""The harvester's Postgres connection pool: dead connections discarded at once, reconnects bounded.

psycopg_pool as it comes hands out idle connections unchecked (after a database restart each dead
one fails one statement), backs reconnection off exponentially from 1 s (after a long outage the
next attempt can be many seconds after Postgres accepts connections again) and, with `check=`,
sleeps 1 s and more between failed checks. Recovery must take well under a second, so:

- a connection whose socket is readable while idle has been closed by the server (a restart or
  a terminated backend sends its goodbye and closes): it is closed and replaced, and every other
  idle connection is checked at once, before the statement is tried. The check is one `select()`
  with no round trip, cheap enough for every checkout;
- a connection broken during a statement is discarded when it is returned (psycopg_pool does that
  by itself) and the remaining idle ones are checked the same way; so is one whose statement
  failed because its server is read-only or shutting down (`needs_new_connection`): after a
  promotion the old primary may answer read-only, and only a new connection through a multi-host
  DSN with target_session_attrs=read-write reaches the new primary;
- reconnection attempts are spaced RECONNECT_FIRST, doubling, at most `reconnect_backoff_max`
  apart (default RECONNECT_MAX), and never give up: a pool of a long-running sidecar must not shrink
  because the database was gone for an hour.
"""

from __future__ import annotations

import select
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg_pool import ConnectionPool
from psycopg_pool.base import AttemptWithBackoff

from harvester import logs
from harvester.db_liveness import with_liveness
from tracker.pooling import configure_for_pooler

RECONNECT_FIRST = 0.05  # seconds before the second connection attempt
RECONNECT_MAX = 0.25  # bound of the doubling: publishing resumes this soon after Postgres is back
CONNECT_TIMEOUT = 5  # seconds: a connect to a host that does not answer at all

# Errors that say the server behind a live connection is no longer the writable primary, or is
# going away: a read-only transaction (an old primary fenced or demoted), an administrator's or a
# crash's shutdown, a server still starting. The connection is dropped, so that a multi-host DSN
# with target_session_attrs=read-write picks the primary again; retrying on it would fail forever.
RECONNECT_SQLSTATES = frozenset({"25006", "57P01", "57P02", "57P03"})


def needs_new_connection(exc: BaseException) -> bool:
    """Whether `exc` means the connection it came from must be replaced, not reused."""
    return isinstance(exc, psycopg.Error) and exc.sqlstate in RECONNECT_SQLSTATES


def out_of_reach(exc: BaseException) -> bool:
    """Whether `exc` says the database was not reached (no connection, a broken one, a pool checkout
    that timed out, a server going away or read-only), rather than an answer of the database's.
    An error the server sent with a SQLSTATE of its own is an answer, even one psycopg files under
    OperationalError (a statement_timeout's cancel, a lock timeout, a full disk); class 08
    (connection exception) is not."""
    if needs_new_connection(exc):
        return True
    if not isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
        return False
    state = exc.sqlstate
    return state is None or state.startswith("08")


def probe_writable(pool: ConnectionPool, timeout: float) -> None:
    """Raises unless the database behind `pool` answers and takes writes, as a mark needs: a
    read-only server (a standby, a primary fenced read-only) answers SELECT 1 while every mark
    fails there, so it raises ReadOnlySqlTransaction (25006, out of reach), and the connection is
    dropped so a multi-host DSN finds the primary again."""
    with pool.connection(timeout=timeout) as conn:
        row = conn.execute("SELECT current_setting('transaction_read_only')").fetchone()
        if row is None or row[0] != "off":
            raise psycopg.errors.ReadOnlySqlTransaction("the database answers but is read-only")


def configure_connection(conn: psycopg.Connection) -> bool:
    """Set up a new pool connection; return whether it goes through a pooler."""
    # Through a transaction pooler (PgBouncer in transaction mode) psycopg must not prepare, and a
    # session SET would stay on a server connection that other clients share (their commits would
    # stop waiting for the WAL flush too): there, set synchronous_commit on the reaper's role instead.
    if configure_for_pooler(conn):
        return True
    # A lost mark or purge only causes a duplicate publication later: no need to wait for the WAL flush.
    conn.execute("SET synchronous_commit = off")
    return False


def closed_by_server(conn: psycopg.Connection) -> bool:
    """True when an idle connection is unusable: closed, broken, or its socket has something to
    read (the server's termination notice or EOF; reaper's connections LISTEN to nothing). A rare
    asynchronous message from a healthy server (a ParameterStatus after a configuration reload)
    reads the same: that connection is replaced for nothing, which costs one reconnect."""
    if conn.closed or conn.broken:
        return True
    try:
        readable, _, _ = select.select([conn.pgconn.socket], [], [], 0)
    except (OSError, ValueError, psycopg.OperationalError):
        return True
    return bool(readable)


class _BoundedAttempt(AttemptWithBackoff):
    INITIAL_DELAY = RECONNECT_FIRST

    def __init__(self, *, timeout: float, cap: float) -> None:
        super().__init__(timeout=timeout)
        self._cap = cap

    def update_delay(self, now: float) -> None:
        super().update_delay(now)
        self.delay = min(self.delay, self._cap)


class HarvestPool(ConnectionPool):
    """A ConnectionPool whose `connection()` never hands out a connection the server has closed."""

    def __init__(self, *args, reconnect_backoff_max: float = RECONNECT_MAX, **kwargs) -> None:
        self.reconnect_backoff_max = reconnect_backoff_max
        super().__init__(*args, **kwargs)

    def _add_connection(self, attempt: AttemptWithBackoff | None, growing: bool = False) -> None:
        # psycopg_pool's own back-off starts at 1 s and doubles up to reconnect_timeout.
        if attempt is None:
            attempt = _BoundedAttempt(timeout=self.reconnect_timeout, cap=self.reconnect_backoff_max)
        super()._add_connection(attempt, growing)

    def reconnect_failed(self) -> None:
        # Never reached with reconnect_timeout=inf; kept so a finite one still refills on demand.
        super().reconnect_failed()

    @contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[psycopg.Connection]:
        conn = self.getconn(timeout)
        while closed_by_server(conn):
            conn.close()  # closed: putconn discards it and schedules a replacement
            self.putconn(conn)
            self.check()  # the others most likely died with it: replace them all now
            conn = self.getconn(timeout)
        try:
            with conn:
                yield conn
        except psycopg.Error as exc:
            if needs_new_connection(exc):
                conn.close()  # putconn discards it; the next checkout connects anew
            raise
        finally:
            broken = conn.closed or conn.broken
            self.putconn(conn)
            if broken:
                self.check()


def make_pool(
    dsn: str,
    size: int,
    *,
    name: str = "reaper",
    open_wait: float | None = 30.0,
    reconnect_backoff_max: float = RECONNECT_MAX,
    timeout: float = 30.0,
) -> HarvestPool:
    """A pool of `size` connections to `dsn`, opened at once, waiting up to `open_wait` seconds for
    them (None: not waiting); `connection()` waits up to `timeout` for one by default."""
    said = False

    def configure(conn: psycopg.Connection) -> None:
        nonlocal said
        if configure_connection(conn) and not said:
            said = True
            logs.get("reaper.store").info(
                "database reached through a pooler (e.g. PgBouncer): prepared "
                "statements off, synchronous_commit left to the role",
                pool=name,
            )

    pool = HarvestPool(
        with_liveness(dsn, connect_timeout=CONNECT_TIMEOUT),  # the DSN's or PGCONNECT_TIMEOUT wins
        min_size=size,
        max_size=size,
        name=name,
        open=False,
        kwargs={"autocommit": True, "application_name": "reaper"},
        configure=configure,
        reconnect_timeout=float("inf"),
        reconnect_backoff_max=reconnect_backoff_max,
        timeout=timeout,
    )
    pool.open(wait=open_wait is not None, timeout=open_wait or 30.0)
    return pool
