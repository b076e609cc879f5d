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
from collections.abc import Callable

import psycopg
from psycopg import sql
from structlog.typing import FilteringBoundLogger

from tracker.schema import check_identifier, qualified

from .store import LANE_SQL

MAX_IDENTIFIER = 63  # Postgres truncates longer names; ours must not collide when it would

_STATE = (
    "SELECT i.indisvalid, EXISTS (SELECT 1 FROM pg_stat_progress_create_index p WHERE p.index_relid = c.oid) "
    "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace JOIN pg_index i ON i.indexrelid = c.oid "
    "WHERE n.nspname = %s AND c.relname = %s"
)

MISSING, BUILDING, INVALID, VALID = "missing", "building", "invalid", "valid"


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
        self.name = lane_index_name(check_identifier(table, "table"), lanes)
        self._create = sql.SQL("CREATE INDEX CONCURRENTLY IF NOT EXISTS {i} ON {t} (({lane}), id)").format(
            i=sql.Identifier(self.name),
            t=qualified(schema, table),
            lane=sql.SQL(LANE_SQL.format(lanes=int(lanes))),
        )
        self._drop = sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {i}").format(i=sql.Identifier(schema, self.name))

    def statement(self) -> str:
        """The CREATE INDEX statement, for an operator to run."""
        return self._create.as_string(None)

    def state(self, conn: psycopg.Connection) -> str:
        row = conn.execute(_STATE, [self.schema, self.name]).fetchone()
        if row is None:
            return MISSING
        valid, building = row
        return VALID if valid else BUILDING if building else INVALID

    def build_step(self, conn: psycopg.Connection) -> str:
        """One step towards a valid index on an autocommit connection; returns the state it found.

        Missing: built (this call lasts as long as the build). Invalid and no build running: dropped
        (the next step builds it). Building: nothing (another reaper's build; the caller waits)."""
        found = self.state(conn)
        if found == MISSING:
            conn.execute(self._create)
        elif found == INVALID:
            conn.execute(self._drop)
        return found


RECHECK_VALID = 60.0  # seconds between checks that a valid index is still there
RECHECK_FIRST = 1.0  # otherwise (being built, not ours to build, refused, the database away): 1 s,
RECHECK_MAX = 60.0  # doubling while nothing changes, to at most this


class LaneIndexKeeper:
    """Builds (lane 0's leader) and watches (every lane's leader) the lane index of one unit's
    table, and switches the unit's mark to it while it is valid. Runs on a thread of its own: a
    build lasts as long as the table takes to index, and holds up no mark."""

    def __init__(
        self, index: LaneIndex, dsn: str, builder: bool, use: Callable[[bool], None], log: FilteringBoundLogger
    ):
        self.index, self.dsn, self.builder, self._use, self._log = index, dsn, builder, use, log
        self.valid = False
        self._refused = False
        self._last_state: str | None = None
        self._wait = RECHECK_FIRST

    def step(self) -> float:
        """Check (and when ours, build) once; return the seconds until the next step."""
        try:
            # A connection of its own, not a pooled one: a build may take long.
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                state = self.index.build_step(conn) if self.builder else self.index.state(conn)
                if self.builder and state in (MISSING, INVALID):
                    state = self.index.state(conn)  # after the build or the drop
        except psycopg.errors.InsufficientPrivilege as exc:
            if not self._refused:
                self._refused = True
                self._log.warning(
                    "cannot build the lane index: marking along the primary key; the table's owner can run",
                    statement=self.index.statement(),
                    error=str(exc).strip(),
                )
            state = None
        except psycopg.Error as exc:
            self._log.warning("lane index check failed", index=self.index.name, error=str(exc).strip())
            state = None
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
            return RECHECK_VALID
        self._wait = RECHECK_FIRST if state != previous else min(RECHECK_MAX, self._wait * 2)
        return self._wait

    def run(self, stop: threading.Event, leading: Callable[[], bool]) -> None:
        """Until `stop`: step while this process leads the unit (a standby touches nothing)."""
        wait = 0.0
        while not stop.wait(wait):
            wait = self.step() if leading() else 1.0
