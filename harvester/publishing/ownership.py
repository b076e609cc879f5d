"""Which configuration harvests an outbox table: one layout at a time, enforced by the database.

A layout is what decides which unit marks which row: the Kafka cluster, leader group and topic
(one election), the outbox entry's name, the leader-topic partition of its first lane and its lane
count. Within one layout the election gives each unit one
leader and each key one lane. Two layouts harvesting one table at once (a lane change whose new
reapers start before the old ones stopped, two deployments pointed at one database, an outbox listed
under two names) would each mark the other's rows from the head: a key harvested by two units at
once, and published out of order. Draining, then switching (the running and scaling how-to) avoids that; this module makes
the database refuse it when the drain was skipped.

Contract (`OutboxClaim.hold`, called before every mark with the mark's own deadline):
- The table's row in `<schema>.harvest_claim` (migration 0011) names one layout and `held_until`,
  a time on the database server's clock. A unit marks only under a deadline no later than a
  `held_until` its layout holds: it extends the row (to its deadline plus CLAIM_AHEAD, never
  shortening it) when the deadline passes what it holds, about once a second, and again whenever
  the database clock's anchor changed (a step of the server's clock must not let an old answer
  stand).
- Another layout takes the row over only once `held_until` has passed on the server's clock. Every
  mark of the old layout carried a deadline no later than that, and the database refuses a mark
  that reaches it, or finishes there, after its deadline (OutboxStore.mark). So the old layout's
  last mark ended before the new layout's first began, even when an old reaper was paused
  (SIGSTOP, a frozen VM) mid-mark and resumes later: its next hold finds the row taken and raises
  OutboxClaimed, naming the layout and reaper that hold it.
- Releasing early is not attempted: the row is shared by all units of a layout, and one stopping
  unit cannot know whether another is mid-mark. After the last reaper of a layout stops, another
  layout waits at most heartbeat_timeout + CLAIM_AHEAD, and then its next try (CLAIM_RETRY).
- A schema without the table (an outbox outside `database.schema`, which `reaper migrate` does not
  touch) gets it from the reaper, with migration 0011's own statement; a role that may not create
  it gets an error log with the statement for the schema's owner, and nothing is marked meanwhile.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import datetime, timedelta

import psycopg
from prometheus_client import Counter
from psycopg import sql
from psycopg_pool import ConnectionPool
from structlog.typing import FilteringBoundLogger

from harvester import logs
from tracker import schema as schema_mod
from tracker.schema import check_identifier, qualified

CLAIM_TABLE = "harvest_claim"
CLAIM_MIGRATION = 11  # sql/0011_harvest_claim.sql creates the table
# Held this far past the mark's deadline, so a unit writes its claim about once a second rather
# than at every heartbeat; it only delays another layout's takeover after this one stopped.
CLAIM_AHEAD = timedelta(seconds=1)
CLAIM_LOG_EVERY = 30.0  # seconds between a unit's error logs about the same refusal (it retries every second)


def layout_of(cluster: str, leader_group: str, leader_topic: str, outbox: str, first_unit: int, lanes: int) -> str:
    """The layout a unit harvests under: equal for every unit and reaper of one configuration, and
    different when anything that decides who marks which row differs (another Kafka cluster is
    another election; reordering harvester.outboxes moves a table to other leader partitions)."""
    return (
        f"cluster={cluster or '?'} group={leader_group} topic={leader_topic} outbox={outbox} "
        f"first_unit={first_unit} lanes={lanes}"
    )


def holder_name(unit: str) -> str:
    return f"{socket.gethostname()} pid {os.getpid()} unit {unit}"


class OutboxClaimed(RuntimeError):
    """Another layout holds the outbox table: this unit must not mark it (nothing was marked)."""

    def __init__(self, outbox: str, mine: str, layout: str, holder: str, held_until: datetime) -> None:
        super().__init__(
            f"outbox {outbox} is harvested by another configuration ({layout}; last held by {holder}, "
            f"until {held_until.isoformat()}), not this one ({mine}): stop the other reapers first "
            "(drain, then switch), or fix the configuration that points at the wrong table"
        )
        self.outbox, self.mine, self.layout, self.holder, self.held_until = outbox, mine, layout, holder, held_until


class ClaimTableMissing(RuntimeError):
    """The reaper cannot hold the table's row: the schema has no harvest_claim table and its role
    may not create it, or its role may not read and write the table."""


# A hold waits at most this long for a lock on the claim row (an operator's open transaction, a
# migration's ALTER): it runs while a revocation waits for the mark, and fails like a mark instead.
HOLD_LOCK_TIMEOUT = "1s"


@dataclass(frozen=True)
class _Statements:
    hold: sql.Composed
    read: sql.Composed
    held_now: sql.Composed
    search_path: sql.SQL
    lock_timeout: sql.Composed
    lock: sql.SQL


class OutboxClaim:
    def __init__(self, pool: ConnectionPool, schema: str, table: str, layout: str, holder: str) -> None:
        self.pool = pool
        self.schema, self.table = check_identifier(schema, "schema"), check_identifier(table, "table")
        self.outbox = f"{schema}.{table}"
        self.layout, self.holder = layout, holder
        self.held: datetime | None = None  # the latest held_until this unit's layout was seen to hold
        self._held_generation = -1  # the database clock's anchor `held` was compared under
        self.holding = False  # the last hold succeeded (this layout holds the table)
        self._refusals = logs.Repeats(CLAIM_LOG_EVERY)  # when the last refusal was logged
        claims = qualified(schema, CLAIM_TABLE)
        self._sql = _Statements(
            # The row lock taken by ON CONFLICT orders concurrent holders; the WHERE leaves a row
            # held by another layout untouched (and returns nothing) until its held_until passed.
            hold=sql.SQL(
                "INSERT INTO {c} AS c (outbox, layout, held_until, holder) "
                "VALUES (%(outbox)s, %(layout)s, %(until)s, %(holder)s) "
                "ON CONFLICT (outbox) DO UPDATE SET "
                "held_until = CASE WHEN c.layout = excluded.layout "
                "THEN greatest(c.held_until, excluded.held_until) ELSE excluded.held_until END, "
                "since = CASE WHEN c.layout = excluded.layout THEN c.since ELSE clock_timestamp() END, "
                "layout = excluded.layout, holder = excluded.holder "
                "WHERE c.layout = excluded.layout OR c.held_until < statement_timestamp() "
                "RETURNING held_until"
            ).format(c=claims),
            read=sql.SQL("SELECT layout, holder, held_until FROM {c} WHERE outbox = %s").format(c=claims),
            held_now=sql.SQL(
                "SELECT EXISTS (SELECT 1 FROM {c} WHERE outbox = %s AND layout = %s AND held_until > clock_timestamp())"
            ).format(c=claims),
            search_path=sql.SQL("SELECT set_config('search_path', %s, true)"),
            lock_timeout=sql.SQL("SELECT set_config('lock_timeout', {t}, true)").format(
                t=sql.Literal(HOLD_LOCK_TIMEOUT)
            ),
            lock=sql.SQL("SELECT pg_advisory_xact_lock(%s)"),  # `reaper migrate`'s, so the two queue
        )

    def hold(self, deadline: datetime, clock_generation: int = 0) -> None:
        """Make sure this layout holds the table until at least `deadline` (the server's clock, as
        mapped under the anchor `clock_generation`), or raise OutboxClaimed (another layout holds
        it), ClaimTableMissing or a database error. Marks nothing itself."""
        if self.held is not None and deadline <= self.held and clock_generation == self._held_generation:
            return
        self.holding = False
        self._held_generation = clock_generation
        params = {"outbox": self.table, "layout": self.layout, "until": deadline + CLAIM_AHEAD, "holder": self.holder}
        try:
            try:
                self.held = self._hold(params)
            except psycopg.errors.UndefinedTable:
                self.create_table()
                self.held = self._hold(params)
            self.holding = True
        except psycopg.errors.InsufficientPrivilege as exc:
            table = qualified(self.schema, CLAIM_TABLE).as_string(None)
            raise ClaimTableMissing(
                f"this role may not use {table} ({exc}): GRANT SELECT, INSERT, UPDATE ON {table} TO <the reaper's role>"
            ) from None

    def held_now(self) -> bool:
        """Whether the database says this layout holds the table at this moment (not the cache);
        raises what the database raised."""
        with self.pool.connection() as conn:
            row = conn.execute(self._sql.held_now, [self.table, self.layout]).fetchone()
        return bool(row and row[0])

    def forget(self) -> None:
        """Ask the database at the next hold (after an error: the server may have failed over)."""
        self.held, self.holding = None, False

    def report_refusal(
        self, why: OutboxClaimed | ClaimTableMissing, log: FilteringBoundLogger, refusals: Counter
    ) -> None:
        """Count a refusal; log it when it is new, and again every CLAIM_LOG_EVERY."""
        refusals.inc()
        what = why.layout if isinstance(why, OutboxClaimed) else str(why)
        if self._refusals.due(what):
            if isinstance(why, OutboxClaimed):
                log.error("not marking: another configuration harvests this outbox table", error=str(why))
            else:
                log.error("not marking: this outbox table's claim cannot be held", error=str(why))

    def _hold(self, params: dict) -> datetime:
        with self.pool.connection() as conn:
            # One pipeline, one Sync: one implicit transaction, all that set_config(..., true) lasts.
            with conn.pipeline():
                conn.execute(self._sql.lock_timeout)
                cur = conn.execute(self._sql.hold, params)
            row = cur.fetchone()
            if row is not None:
                return row[0]
            other = conn.execute(self._sql.read, [self.table]).fetchone()
        if other is None:  # deleted by hand between the two statements: the next hold takes it
            raise OutboxClaimed(self.outbox, self.layout, "(none)", "(deleted meanwhile)", params["until"])
        raise OutboxClaimed(self.outbox, self.layout, *other)

    def create_statement(self) -> str:
        """Migration 0011's statement, for this schema (what an owner runs where the reaper may not)."""
        return f"SET search_path TO {sql.Identifier(self.schema).as_string(None)};\n{self._migration_text()}"

    @staticmethod
    def _migration_text() -> str:
        for m in schema_mod.migrations():
            if m.version == CLAIM_MIGRATION:
                return m.text
        raise RuntimeError(f"migration {CLAIM_MIGRATION:04d} is missing from this installation")

    def create_table(self) -> None:
        """Create the schema's harvest_claim table (IF NOT EXISTS), or raise ClaimTableMissing."""
        try:
            with self.pool.connection() as conn, conn.transaction():
                conn.execute(self._sql.lock, [schema_mod.migration_lock_key(self.schema)])
                conn.execute(self._sql.search_path, [sql.Identifier(self.schema).as_string(conn)])
                conn.execute(self._migration_text())
        except (psycopg.errors.InsufficientPrivilege, psycopg.errors.InvalidSchemaName) as exc:
            raise ClaimTableMissing(
                f"{self.schema}.{CLAIM_TABLE} does not exist and this role cannot create it ({exc}); "
                f"have the schema's owner run `reaper migrate` for it, or:\n{self.create_statement()}"
            ) from None
        except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateObject, psycopg.errors.DuplicateTable):
            pass  # created at the same moment by a session that does not take the lock (an operator)
