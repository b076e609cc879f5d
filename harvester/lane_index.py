"""The lane index: an index on (lane of key, id) of an outbox table harvested in lanes.

Without it, a lane's mark walks the primary key in id order and computes every row's lane (an MD5)
to pass over the other lanes' rows: with L lanes it reads about L rows, and hashes L - 1 others'
keys, for each row of its own, so the database's work per record grows with the lane count (4
lanes, 5,000-row mark: 26.7 ms; 7.5 ms through this index). With it, each lane reads its own rows
only, in id order: `OutboxStore.use_lane_index(True)` switches the mark to a range of the index.

The index costs every insert into the outbox one more index entry and one MD5 of the key, so it is
built only for tables harvested in lanes (`harvester.lanes` > 1, `harvester.lane_index`). The
reaper leading lane 0 builds it, CONCURRENTLY (the application's inserts go on), in the background;
every lane's harvester switches to it once Postgres reports it valid. A build interrupted (a reaper
stopped meanwhile) leaves an invalid index, which the next attempt drops and builds again. Without
the privilege to build it (the reaper's role does not own the table), the reaper logs the
statement for the table's owner to run, once, and marks without it.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable

import psycopg
from psycopg import sql
from structlog.typing import FilteringBoundLogger

from harvester.db_liveness import with_liveness
from harvester.publishing.outbox_sql import LANE_SQL
from tracker.schema import check_identifier, qualified

MAX_IDENTIFIER = 63  # Postgres truncates longer names; ours must not collide when it would

# An index on the lane expression (LANE_SQL, as Postgres deparses it: `md5(key)` inside).
_ON_LANES = "strpos(pg_get_indexdef(c.oid), 'md5(key)') > 0"

# Every lane index the reaper builds (or marks through) is labelled with a comment starting so: only
# those are ever dropped as retired (an index someone else made under a similar name is left alone).
LABEL = "outbox-reaper lane index"

# Building: a CREATE INDEX in progress on it, or another session holding the table's SHARE UPDATE
# EXCLUSIVE lock (a build, by any role: pg_stat_progress_create_index hides other roles' builds from
# a role without pg_read_all_stats; or a VACUUM, which only delays the check).
# _ON_LANES is read in the select list, never in WHERE: there the planner may evaluate it on other
# schemas' indexes before the name filters, and pg_get_indexdef fails on one dropped meanwhile.
_STATE = (
    "SELECT i.indisvalid, EXISTS (SELECT 1 FROM pg_stat_progress_create_index p WHERE p.index_relid = c.oid) "
    "OR EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'relation' AND l.relation = i.indrelid "
    "AND l.mode = 'ShareUpdateExclusiveLock' AND l.granted AND l.pid <> pg_backend_pid()), "
    "obj_description(c.oid, 'pg_class'), " + _ON_LANES + " "
    "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace JOIN pg_index i ON i.indexrelid = c.oid "
    "WHERE n.nspname = %s AND c.relname = %s AND i.indrelid = to_regclass(%s)"
)

MISSING, BUILDING, INVALID, VALID = "missing", "building", "invalid", "valid"

# The labelled lane indexes of a table (on its lane expression, whatever else the label says).
_LABELLED = (
    "SELECT c.relname, " + _ON_LANES + " FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
    "WHERE i.indrelid = to_regclass(%s) AND starts_with(coalesce(obj_description(c.oid, 'pg_class'), ''), %s) "
    "ORDER BY c.relname"
)
RETIRE_WAIT = 5.0  # seconds a drop may wait for other sessions' locks on the table before it is cancelled


def lane_index_name(table: str, lanes: int) -> str:
    """`<table>_lanes<L>`; when that is longer than Postgres keeps, a prefix and a hash of the whole."""
    name = f"{table}_lanes{lanes}"
    if len(name.encode()) <= MAX_IDENTIFIER:
        return name
    digest = hashlib.md5(name.encode()).hexdigest()[:8]
    suffix = f"_{digest}_lanes{lanes}"
    prefix = table.encode()[: MAX_IDENTIFIER - len(suffix)].decode(errors="ignore")
    return prefix + suffix


class LaneIndex:
    """The lane index of one outbox table for one lane count."""

    def __init__(self, schema: str, table: str, lanes: int) -> None:
        if not (isinstance(lanes, int) and lanes > 1):
            raise ValueError(f"lanes {lanes!r}: a lane index is for 2 or more lanes")
        self.schema, self.table, self.lanes = schema, table, lanes
        self.comment: str | None = None  # the comment the last state() found on it
        self.label_refused = False  # this role may not comment on it: do not ask every check
        self.name = lane_index_name(check_identifier(table, "table"), lanes)
        self._create = sql.SQL("CREATE INDEX CONCURRENTLY IF NOT EXISTS {i} ON {t} (({lane}), id)").format(
            i=sql.Identifier(self.name),
            t=qualified(schema, table),
            lane=sql.SQL(LANE_SQL.format(lanes=int(lanes))),
        )
        self._drop = _drop_statement(schema, self.name)
        self._label_text = f"{LABEL} (lanes={lanes})"
        self._label = sql.SQL("COMMENT ON INDEX {i} IS {label}").format(
            i=sql.Identifier(schema, self.name), label=sql.Literal(self._label_text)
        )
        self._table = qualified(schema, table).as_string(None)

    def statement(self) -> str:
        """The statements that build it, for an operator to run (the label lets a later reaper drop
        it once a configuration with another lane count has taken the table over)."""
        return f"{self._create.as_string(None)}; {self._label.as_string(None)};"

    @property
    def labelled(self) -> bool:
        """The last state() found it carrying the reaper's label (or label() put it there)."""
        return (self.comment or "").startswith(LABEL)

    def state(self, conn: psycopg.Connection) -> str:
        """MISSING, BUILDING, INVALID or VALID: an index of this name on this table (its comment in
        `comment`)."""
        row = conn.execute(_STATE, [self.schema, self.name, self._table]).fetchone()
        if row is None or not row[3]:  # an index of that name on another expression: as good as missing
            self.comment = None
            return MISSING
        valid, building, self.comment, _ = row
        return VALID if valid else BUILDING if building else INVALID

    def label(self, conn: psycopg.Connection) -> None:
        """Label the index (found on this table by state()): one this reaper builds or marks
        through is one a later configuration may retire. An index carrying another comment keeps
        it (and stays unlabelled); a role that does not own it is not asked again."""
        if self.comment is not None or self.label_refused:
            return
        try:
            conn.execute(self._label)
            self.comment = self._label_text
        except psycopg.errors.InsufficientPrivilege:
            self.label_refused = True

    def build_step(self, conn: psycopg.Connection, found: str | None = None) -> str:
        """One step towards a valid index on an autocommit connection; returns the state it found
        (`found`, when the caller has just read it).

        Missing: built (this call lasts as long as the build). Invalid and no build running: dropped
        (the next step builds it). Building: nothing (another reaper's build; the caller waits)."""
        if found is None:
            found = self.state(conn)
        if found == MISSING:
            conn.execute(self._create)
            # IF NOT EXISTS passes over a name taken by another table's index: label only ours
            if self.state(conn) != MISSING:
                self.label(conn)
        elif found == INVALID:
            conn.execute(self._drop)
        return found


def _drop_statement(schema: str, name: str) -> sql.Composed:
    return sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {i}").format(i=sql.Identifier(schema, name))


class NotHeld(RuntimeError):
    """The configuration no longer holds the table: lane indexes are left for now."""


def retire_lane_indexes(
    conn: psycopg.Connection, schema: str, table: str, keep: str | None, still_ours: Callable[[], bool]
) -> list[str]:
    """Drop (CONCURRENTLY, on an autocommit connection) the labelled lane indexes of the table
    other than `keep`: those a configuration with another lane count (or none) built. Returns the
    names dropped. Run by a unit whose layout holds the table (harvester.publishing.ownership), checked again by
    `still_ours` before each drop (NotHeld when it says no), so no other configuration marks
    through them any more; an index only speeds marks up, so one dropped under a configuration
    that takes the table back later is rebuilt by it. A drop waits for every session holding a
    lock on the table, and meanwhile holds back vacuum and builds: it is cancelled after
    RETIRE_WAIT (QueryCanceled; the index is left invalid, and labelled, for the next attempt)."""
    t = qualified(check_identifier(schema, "schema"), check_identifier(table, "table")).as_string(conn)
    dropped = []
    for name, on_lanes in conn.execute(_LABELLED, [t, LABEL]).fetchall():
        if name == keep or not on_lanes:
            continue
        if not still_ours():
            raise NotHeld(f"{schema}.{table} is no longer this configuration's")
        _drop_within(conn, _drop_statement(schema, name))
        dropped.append(name)
    return dropped


def _drop_within(conn: psycopg.Connection, statement: sql.Composed) -> None:
    """Run `statement`, cancelled if it still runs after RETIRE_WAIT. The cancel is sent only while
    the statement runs, and the next statement waits until it was sent (a cancel that reaches an
    idle server session is ignored), so it never hits a later statement."""
    lock, running = threading.Lock(), [True]

    def cancel() -> None:
        with lock:
            if running[0]:
                conn.cancel_safe()

    timer = threading.Timer(RETIRE_WAIT, cancel)
    timer.start()
    try:
        conn.execute(statement)
    finally:
        with lock:
            running[0] = False
        timer.cancel()


# Seconds to the next step. A valid index is checked often on a kept connection (one catalog query):
# once it is gone, each mark through it scans the whole table until the lane switches back.
RECHECK_VALID = 5.0
RECHECK_FIRST = 1.0  # being built elsewhere, not ours to build: 1 s, doubling while nothing changes,
RECHECK_MAX = 60.0  # to at most this
RECHECK_FAILED_MAX = 900.0  # a build or check that fails: 2 s, doubling while it keeps failing, to this


class LaneIndexKeeper:
    """Builds (lane 0's leader) and watches (every lane's leader) the lane index of one unit's
    table, and switches the unit's mark to it while it is valid. Runs on a thread of its own: a
    build lasts as long as the table takes to index, and holds up no mark."""

    def __init__(
        self, index: LaneIndex, dsn: str, builder: bool, use: Callable[[bool], None], log: FilteringBoundLogger
    ):
        self.index, self.dsn, self.builder, self._use, self._log = index, dsn, builder, use, log
        self.may_build: Callable[[], bool] = lambda: (
            True
        )  # harvester.publishing.ownership: while its layout holds the table
        self.valid = False
        self.failures = 0  # in a row; back to 0 once the index is seen valid
        self._last_state: str | None = None
        self._wait = RECHECK_FIRST
        self._conn: psycopg.Connection | None = None
        self._wake = threading.Event()

    def recheck_soon(self) -> None:
        """Check at once (the marker saw a refused, failed or slow mark: the index may be gone)."""
        self._wake.set()

    def _connection(self) -> psycopg.Connection:
        # Its own, not a pooled one: a build may take long.
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(with_liveness(self.dsn), autocommit=True)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    def step(self) -> float:
        """Check (and when ours, build) once; return the seconds until the next step."""
        try:
            conn = self._connection()
            state = found = self.index.state(conn)
            if self.builder and found == VALID and not self.index.labelled:
                self.index.label(conn)  # built by an earlier version or an operator: ours from now on
            if self.builder and found in (MISSING, INVALID) and self.may_build():
                if found == MISSING:
                    self._log.info("building the lane index", statement=self.index.statement())
                started = time.monotonic()
                self.index.build_step(conn, found)
                state = self.index.state(conn)
                if state == VALID:
                    self._log.info(
                        "lane index built", index=self.index.name, seconds=round(time.monotonic() - started, 3)
                    )
                elif found == MISSING or state != MISSING:  # built and not valid, or dropped and still there
                    return self._failed(f"found {found}, left {state}", state)
        except psycopg.errors.InsufficientPrivilege as exc:
            return self._failed(str(exc).strip(), None, hint="the table's owner can run the statement")
        except psycopg.Error as exc:
            self.close()
            return self._failed(str(exc).strip(), self._last_state)  # the index's state is unknown: keep the last
        return self._settle(state)

    def _settle(self, state: str | None) -> float:
        valid = state == VALID
        if valid != self.valid:
            self._log.info(
                "marking through the lane index" if valid else "lane index not valid: marking along the primary key",
                index=self.index.name,
                state=state,
            )
        self.valid = valid
        self._use(valid)
        previous, self._last_state = self._last_state, state
        if valid:
            self.failures = 0
            return RECHECK_VALID
        self._wait = RECHECK_FIRST if state != previous else min(RECHECK_MAX, self._wait * 2)
        return self._wait

    def _failed(self, error: str, state: str | None, hint: str = "") -> float:
        self.failures += 1
        wait = min(RECHECK_FAILED_MAX, RECHECK_FIRST * 2**self.failures)
        if self.failures & (self.failures - 1) == 0:  # the 1st, 2nd, 4th, 8th... failure in a row
            self._log.warning(
                "lane index: marking along the primary key meanwhile",
                index=self.index.name,
                error=error,
                failures=self.failures,
                retry_in_s=wait,
                statement=self.index.statement(),
                **({"hint": hint} if hint else {}),
            )
        self._settle(state)
        return wait

    def run(self, stop: threading.Event, leading: Callable[[], bool]) -> None:
        """Until `stop`: step while this process leads the unit (a standby touches nothing)."""
        try:
            wait = 0.0
            while not stop.is_set():
                deadline = time.monotonic() + wait
                while not (stop.is_set() or self._wake.is_set()) and time.monotonic() < deadline:
                    stop.wait(min(0.1, deadline - time.monotonic()))
                self._wake.clear()
                if stop.is_set():
                    break
                wait = self.step() if leading() else 1.0
        finally:
            self.close()
