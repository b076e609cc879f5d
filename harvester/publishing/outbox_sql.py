"""The harvester's SQL on the outbox: mark, purge, reset, quarantine, vacuum and the backlog gauges.

Identifiers come from configuration, are validated and quoted with psycopg.sql.Identifier.
Connections come from a psycopg_pool pool in autocommit mode: every statement is its own
transaction, one round trip, prepared by psycopg after a few uses (not through a transaction
pooler such as PgBouncer: see `configure_connection`).
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import compress, repeat
from operator import itemgetter, ne, sub

import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool

from harvester.db_pool import configure_connection, make_pool  # noqa: F401  (the pool lives in harvester.db_pool)
from harvester.publishing.table_shape import check_shape
from tracker import message_ids
from tracker.schema import qualified

COLUMNS = "id, topic, key, value, header_keys, header_values, kafka_partition"
# What a mark returns per row: COLUMNS, then the row's message id (tracker.message_ids), built by
# Postgres from bound parameters (MESSAGE_ID_SQL): the producing thread, which holds the GIL most
# of a harvest, only zips and produces. A table of the application's own may let `created_at` be
# NULL: such a row is named as if created at -infinity (one NULL row must not stop every later one).
MARKED = COLUMNS + ", " + message_ids.MESSAGE_ID_SQL
LOCK_NOT_AVAILABLE = "55P03"  # the SQLSTATE of VACUUM (SKIP_LOCKED)'s "skipping vacuum" warning


class MarkRefused(RuntimeError):
    """The mark reached the server, or finished there, after its `until`: nothing was marked."""


class TableReplaced(RuntimeError):
    """The outbox table is not the one whose namespace was read (dropped and created again, as a
    restore in one transaction does): nothing was marked; read the namespace again."""


# A mark's `until` when the caller sets none (tools, tests): a timestamptz the server accepts.
FOREVER = datetime(9999, 12, 31, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Backlog:
    rows: int  # exact up to BACKLOG_EXACT, above it the id span (see OutboxStore.backlog)
    oldest_age: float  # seconds since the oldest unpublished row was created; 0 when empty
    exact: bool = True  # False when `rows` is the id span


# Counting is exact up to here (a few ms). Above it the gauge reads the id span instead (two
# primary-key probes): a gauge must not scan millions of rows every few seconds just when the
# database is already behind. The span is current even when nothing is published or vacuumed (a
# stall, which is when the gauge matters); it is an upper bound, counting ids that rolled-back
# inserts used and rows published out of id order that are already gone.
BACKLOG_EXACT = 100_000


def bigint_array(ids: Sequence[int]) -> str:
    """The text form of a bigint[] parameter (still bound, never SQL text; the server parses it and
    refuses anything but integers): about 4x cheaper than psycopg adapting a list element by element,
    which counts at tens of thousands of ids a second."""
    return "{" + ",".join(map(str, ids)) + "}"


# A purge deletes a run of at least this many consecutive ids by range (one index range scan), and
# the rest by id list (one index probe per id): about half the database CPU per purged row.
PURGE_RUN = 64


def runs_of(ids: Sequence[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """The distinct ids as runs of consecutive ids at least PURGE_RUN long (first, last) and the ids
    in no such run. A run covers exactly its ids: ids are unique in the table, so the rows whose id
    lies between a run's first and last are the rows with one of its ids."""
    ordered = sorted(set(ids))
    n = len(ordered)
    if not n:
        return [], []
    if ordered[-1] - ordered[0] + 1 == n:  # the common case: one mark, nothing in between
        return ([(ordered[0], ordered[-1])], []) if n >= PURGE_RUN else ([], ordered)
    if n < PURGE_RUN:
        return [], ordered
    # Where a stretch of consecutive ids starts (index 0, and every i whose id is not its
    # predecessor's + 1), and the stretches at least PURGE_RUN long: found by C-level iteration
    # (map, compress), not a Python loop per id. A settle batch is usually the reports of a few
    # partitions, whose ids interleave: mostly short stretches, often none long enough.
    starts = [0, *compress(range(1, n), map(ne, map(sub, ordered[1:], ordered), repeat(1))), n]
    lengths = list(map(sub, starts[1:], starts))
    long = [i for i, length in enumerate(lengths) if length >= PURGE_RUN]
    if not long:
        return [], ordered
    runs: list[tuple[int, int]] = []
    singles: list[int] = []
    at = 0
    for i in long:
        first, end = starts[i], starts[i + 1]
        singles.extend(ordered[at:first])
        runs.append((ordered[first], ordered[end - 1]))
        at = end
    singles.extend(ordered[at:])
    return runs, singles


def lane_of(key: bytes | None, lanes: int) -> int:
    """The lane of a key: the first 32 bits of its MD5, modulo the lane count; a null key is in lane 0.
    The same in SQL (LANE_SQL) and here, so an application can tell which unit harvests a key."""
    if key is None or lanes == 1:
        return 0
    return int(hashlib.md5(key).hexdigest()[:8], 16) % lanes


# MD5 rather than hashtextextended(): defined the same everywhere (and in every client language),
# and a few hundred nanoseconds per row is small beside the mark's own cost.
LANE_SQL = "coalesce(mod(('x' || left(md5(key), 8))::bit(32)::bigint, {lanes}), 0)"

# The planner cannot estimate `LANE_SQL = lane` (it guesses 0.5% of the rows match), so with a
# backlog it prefers scanning and sorting the whole table, every mark, to walking the primary key
# in id order: 200k rows, lanes=2: 210 ms per 5,000-row mark against 19 ms. A lane's mark pins the
# id-order walk for its own (implicit) transaction only: nothing leaks to the pooled session.
LANE_MARK_PLAN = (
    "SELECT set_config('enable_seqscan', 'off', true), set_config('enable_bitmapscan', 'off', true), "
    "set_config('max_parallel_workers_per_gather', '0', true)"
)
# Every mark's own transaction reads time in UTC: the message id (MESSAGE_ID_SQL) of a row whose
# created_at is an application's `timestamp` or `date` column, cast to timestamptz in the session's
# TimeZone, would otherwise change with a role's, a database's or a pooled connection's setting
# between two publications of the same row. A timestamptz column is the same in every zone.
MARK_IN_UTC = "set_config('TimeZone', 'UTC', true)"


class OutboxStore:
    def __init__(
        self,
        pool: ConnectionPool,
        schema: str,
        table: str = "outbox",
        dead_table: str | None = None,
        lane: int = 0,
        lanes: int = 1,
    ) -> None:
        if not (isinstance(lanes, int) and isinstance(lane, int) and 0 <= lane < lanes):
            raise ValueError(f"lane {lane!r} of {lanes!r}: need 0 <= lane < lanes")
        self.pool = pool
        self.lane, self.lanes = lane, lanes
        self.schema_name, self.table_name = schema, table
        t = qualified(schema, table)
        self.table = t
        dead = qualified(schema, dead_table or f"{table}_dead")
        # id = ANY(ARRAY(subquery)) keeps the plan on the primary key (a join plan seq-scans the
        # table). No SKIP LOCKED: skipping a row locked by a purge/reset in progress, or by an
        # application, would let a later row of the same key be marked before it. Without FOR
        # UPDATE in the subquery the UPDATE itself waits for such a lock and then re-checks the row
        # (gone: skipped; still unmarked by us: marked), at half the WAL of lock-then-update.
        # Always from the head, never above a cursor: a row committed late below a cursor would be
        # passed over while a causally later row of its key (a higher id) is marked (invariant 6).
        # A lane (lanes > 1) marks only the rows whose key hashes to it: every row of a key is in one
        # lane, so per-key order is kept within one unit, and no row is ever marked by two units.
        mark = (
            "UPDATE {t} SET leader_id = %(me)s WHERE id = ANY(ARRAY("
            "SELECT id FROM {t} WHERE (leader_id IS NULL OR leader_id <> %(me)s){in_lane}"
            " ORDER BY {order} LIMIT %(n)s)) AND (leader_id IS NULL OR leader_id <> %(me)s) "
            "AND statement_timestamp() < %(until)s "
            "RETURNING " + MARKED
        )
        if lanes == 1:
            # With one lane the rows to mark are exactly those not marked by `me` with an id between
            # the lowest and the highest id of that same subquery (same snapshot: it took them all,
            # in id order), so the UPDATE walks that id range once instead of probing the primary
            # key once per id: about a quarter less database CPU per marked row. The row-level
            # re-check of a row changed meanwhile is the same as by id list (its id still matches).
            self._mark = sql.SQL(
                "WITH head AS (SELECT min(id) AS low, max(id) AS high FROM ("
                "SELECT id FROM {t} WHERE (leader_id IS NULL OR leader_id <> %(me)s) ORDER BY id LIMIT %(n)s) AS s) "
                "UPDATE {t} SET leader_id = %(me)s WHERE id >= (SELECT low FROM head) AND id <= (SELECT high FROM head) "
                "AND (leader_id IS NULL OR leader_id <> %(me)s) AND statement_timestamp() < %(until)s "
                "RETURNING " + MARKED
            ).format(t=t)
            self._mark_indexed = self._mark
        else:
            lane_expr = sql.SQL(LANE_SQL.format(lanes=int(lanes)))
            self._mark = sql.SQL(mark).format(
                t=t,
                in_lane=sql.SQL(" AND {e} = {lane}").format(e=lane_expr, lane=sql.Literal(int(lane))),
                order=sql.SQL("id"),
            )
            # Through the lane index (harvester.lane_index), as a range of it: with `lane = L` the
            # planner would take the ordering as plain id order and keep walking the primary key.
            self._mark_indexed = sql.SQL(mark).format(
                t=t,
                in_lane=sql.SQL(" AND ({e}, id) >= ({lane}, {low}) AND ({e}, id) < ({above}, {low})").format(
                    e=lane_expr,
                    lane=sql.Literal(int(lane)),
                    above=sql.Literal(int(lane) + 1),
                    low=sql.SQL("(-9223372036854775807 - 1)::bigint"),
                ),
                order=sql.SQL("{e}, id").format(e=lane_expr),
            )
        self._lane_index = False
        # run first in every mark's transaction (a lane's mark also pins its plan)
        self._mark_settings = f"{LANE_MARK_PLAN}, {MARK_IN_UTC}" if lanes > 1 else f"SELECT {MARK_IN_UTC}"
        self._now = "SELECT clock_timestamp()"
        # Run after the mark, before the one Sync: if the mark finished after `until` (it waited on
        # a row lock, say), this divides by zero and the implicit transaction takes the mark back.
        self._finished_in_time = "SELECT 1 / (clock_timestamp() < %(until)s)::int"
        # Likewise before the Sync: the rows marked are of the table whose namespace the message ids
        # are built with (OutboxStore.namespace), else an invalid int takes the mark back.
        self._same_table = "SELECT (CASE WHEN to_regclass(%(t)s)::oid = %(oid)s THEN '1' ELSE 'replaced' END)::int"
        self._table_text = f'"{schema}"."{table}"'  # identifiers checked by qualified() above
        self._table_oid: int | None = None  # of the table when its namespace was read
        self._ids: message_ids.Namespace | None = None  # that namespace
        self._purge = sql.SQL("DELETE FROM {t} WHERE id = ANY(%s::bigint[]) AND leader_id = %s").format(t=t)
        self._purge_run = sql.SQL("DELETE FROM {t} WHERE id >= %s AND id <= %s AND leader_id = %s").format(t=t)
        self._reset = sql.SQL("UPDATE {t} SET leader_id = NULL WHERE id = ANY(%s::bigint[]) AND leader_id = %s").format(
            t=t
        )
        # One statement: the row leaves the outbox and enters the dead table together, or not at all.
        self._quarantine = sql.SQL(
            "WITH gone AS (DELETE FROM {t} WHERE id = ANY(%(ids)s::bigint[]) AND leader_id = %(me)s "
            "RETURNING id, created_at, topic, key, value, header_keys, header_values, kafka_partition, leader_id) "
            "INSERT INTO {d} (id, created_at, topic, key, value, header_keys, header_values, kafka_partition, "
            "leader_id, reason) SELECT id, created_at, topic, key, value, header_keys, header_values, "
            "kafka_partition, leader_id, %(reason)s FROM gone"
        ).format(t=t, d=dead)
        # SKIP_LOCKED: not behind a lane index build (harvester.lane_index) or the application's DDL.
        self._vacuum = sql.SQL("VACUUM (SKIP_LOCKED) {t}").format(t=t)
        self._oldest = sql.SQL(
            "SELECT extract(epoch FROM clock_timestamp() - created_at) FROM {t} ORDER BY id LIMIT 1"
        ).format(t=t)
        self._count = sql.SQL("SELECT count(*) FROM (SELECT 1 FROM {t} LIMIT %s) AS s").format(t=t)
        self._span = sql.SQL("SELECT max(id) - min(id) + 1 FROM {t}").format(t=t)
        # Rows deleted from the table by anyone (cumulative statistics, flushed by each backend about
        # once a second): what tells lane 0's vacuum that other lanes, or other processes, purge.
        self._deleted = "SELECT n_tup_del FROM pg_stat_all_tables WHERE relid = to_regclass(%s)"

    def namespace(self) -> message_ids.Namespace:
        """The table's message-id namespace (tracker.message_ids; registered on first use). In a
        schema `reaper migrate` never ran in, the namespace table is created first, as the claim
        table is (harvester.publishing.ownership). The table's columns are checked first
        (harvester.publishing.table_shape): OutboxShapeRefused names those it cannot publish."""
        with self.pool.connection() as conn:
            check_shape(conn, self._table_text)  # OutboxShapeRefused: a column it cannot publish
            # The table's oid first: if it is replaced before the namespace read, the next mark sees it.
            found = conn.execute("SELECT to_regclass(%s)::oid", [self._table_text]).fetchone()
            self._table_oid = found[0] if found else None
            try:
                self._ids = message_ids.namespace(conn, self.schema_name, self.table_name)
                return self._ids
            except message_ids.NamespaceUnavailable as exc:
                if not exc.missing_table:
                    raise
            message_ids.create_table(conn, self.schema_name)
            self._ids = message_ids.namespace(conn, self.schema_name, self.table_name)
            return self._ids

    def mark(
        self, leader_id: uuid.UUID, limit: int, *, until: datetime, ids: message_ids.Namespace | None = None
    ) -> list[tuple]:
        """Mark up to `limit` of the lowest-id rows not marked by `leader_id`; sorted by id. Each row
        is (id, topic, key, value, header_keys, header_values, kafka_partition, message id): the id
        in namespace `ids` (Namespace.message_id; without `ids`, the one `namespace()` read last,
        read first if it never ran).

        Every mark scans from the head of the table. Skipping ahead with a cursor would miss a row
        whose (slow) transaction commits below the cursor while a later row of the same key is
        marked above it; the leader's vacuum upkeep keeps the head cheap to scan instead.

        `until` is the end of the leadership the mark was checked under, on the server's clock
        (harvester.election.db_clock; FOREVER for tools and tests). A mark that reaches the server after it
        does nothing, and one that finishes after it (it waited on a row lock) is taken back with
        the rest of its implicit transaction: both raise MarkRefused, and nothing is marked. A
        leader paused between its lease check and its mark (SIGSTOP, a VM pause) so takes no row
        from its successor on waking. All or nothing: never a set with holes in id order.
        """
        if ids is None:
            ids = self._ids if self._ids is not None else self.namespace()
        params = {"me": leader_id, "n": limit, "until": until, **message_ids.message_id_params(ids)}
        statement = self._mark_indexed if self._lane_index else self._mark
        with self.pool.connection() as conn:
            try:
                # One pipeline, one Sync: the statements run in one implicit transaction (all that
                # SET LOCAL lasts; what the closing check takes back), in one round trip.
                with conn.pipeline():
                    conn.execute(self._mark_settings)
                    cur = conn.cursor(binary=True)
                    message_ids.bind_micros2000(cur.adapters)
                    cur.execute(statement, params)
                    if self._table_oid is not None:
                        conn.execute(self._same_table, {"t": self._table_text, "oid": self._table_oid})
                    if until is not FOREVER:
                        conn.execute(self._finished_in_time, {"until": until})
            except psycopg.errors.DivisionByZero:
                raise MarkRefused(f"the mark finished after its deadline {until.isoformat()}") from None
            except psycopg.errors.InvalidTextRepresentation:
                raise TableReplaced(f"{self._table_text} was replaced since its namespace was read") from None
            rows = cur.fetchall()
        rows.sort(key=itemgetter(0))
        return rows

    def use_lane_index(self, valid: bool) -> None:
        """Mark through the lane index (harvester.lane_index) while `valid`, else along the primary key."""
        self._lane_index = bool(valid) and self.lanes > 1

    def database_now(self) -> datetime:
        """The database server's clock."""
        with self.pool.connection() as conn:
            row = conn.execute(self._now).fetchone()
        assert row is not None  # a SELECT without FROM returns one row
        return row[0]

    def purge(self, leader_id: uuid.UUID, ids: Sequence[int]) -> int:
        """Delete published rows still marked by `leader_id`; return how many went. Runs of
        consecutive ids go by range (see runs_of), in one round trip and one transaction with the rest."""
        runs, singles = runs_of(ids)
        with self.pool.connection() as conn:
            if not runs:
                return conn.execute(self._purge, [bigint_array(singles), leader_id]).rowcount
            with conn.pipeline():
                cursors = [conn.execute(self._purge_run, [first, last, leader_id]) for first, last in runs]
                if singles:
                    cursors.append(conn.execute(self._purge, [bigint_array(singles), leader_id]))
            return sum(c.rowcount for c in cursors)

    def reset(self, leader_id: uuid.UUID, ids: Sequence[int]) -> int:
        """Unmark rows whose publication failed, if still marked by `leader_id`."""
        with self.pool.connection() as conn:
            return conn.execute(self._reset, [bigint_array(ids), leader_id]).rowcount

    def quarantine(self, leader_id: uuid.UUID, ids: Sequence[int], reason: str) -> int:
        """Move rows Kafka will never accept, if still marked by `leader_id`, to the dead table.

        Returns how many moved (0: the rows were remarked by a newer id or are already gone).
        """
        with self.pool.connection() as conn:
            return conn.execute(
                self._quarantine, {"ids": bigint_array(ids), "me": leader_id, "reason": reason}
            ).rowcount

    def vacuum(self) -> bool:
        """VACUUM the outbox; False when Postgres skipped it (SKIP_LOCKED: another session holds a
        conflicting lock, e.g. a lane index build or drop, or DDL), which it says only in a WARNING."""
        skipped: list[str] = []

        def on_notice(diag: psycopg.errors.Diagnostic) -> None:
            if diag.sqlstate == LOCK_NOT_AVAILABLE:
                skipped.append(diag.message_primary or "")

        with self.pool.connection() as conn:
            conn.add_notice_handler(on_notice)
            try:
                conn.execute(self._vacuum)
            finally:
                conn.remove_notice_handler(on_notice)
        return not skipped

    def deleted_rows(self) -> int | None:
        """Rows deleted from the outbox since Postgres's statistics began (any session, any lane);
        None when the table is not there. Lags the deletions by about a second; goes back to 0 when
        the statistics are reset."""
        with self.pool.connection() as conn:
            row = conn.execute(self._deleted, [self._table_text]).fetchone()
        return None if row is None else int(row[0])

    def backlog(self, exact_up_to: int = BACKLOG_EXACT) -> Backlog:
        """Rows in the outbox and the age of the oldest: an exact count up to `exact_up_to` rows,
        above it the id span max(id) - min(id) + 1 (see BACKLOG_EXACT), at least `exact_up_to` + 1."""
        with self.pool.connection() as conn:
            counted = conn.execute(self._count, [exact_up_to + 1]).fetchone()
            assert counted is not None  # an aggregate without GROUP BY returns exactly one row
            rows = counted[0]
            exact = rows <= exact_up_to
            if not exact:
                spanned = conn.execute(self._span).fetchone()
                assert spanned is not None  # likewise one row; max() - min() is NULL on an empty table
                rows = max(exact_up_to + 1, spanned[0] or 0)
            oldest = conn.execute(self._oldest).fetchone()
        return Backlog(rows=rows, oldest_age=max(0.0, float(oldest[0])) if oldest else 0.0, exact=exact)
