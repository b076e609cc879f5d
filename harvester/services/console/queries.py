"""The console's own reads of the batch table and the dead table: each one bounded, by an index.

- Unfinished batches (open, closed): the partial index batch_unfinished, newest id first, a page
  of LIMIT rows after a keyset cursor (`before` = the last id shown).
- Finished batches (complete, expired): the partial index batch_finished on their finish time,
  newest first, keyset on (finish time, id).
- Search: by id (the primary key), or by user key (exact match, newest first): the index
  batch_user_key on (user_key, id), whatever the age of the batch.
- A dead row: by its id (the dead table's primary key), with the first bytes of its value only.
The overview's count of unfinished batches stops at UNFINISHED_EXACT index entries; above it the
page shows "more than" that, with an estimate from the planner's statistics (the index's entries,
pg_class.reltuples of batch_unfinished, times the tenant's share of the batch table in pg_stats, as
of the last ANALYZE: no row is read for it, and nothing of other tenants' volume shows).
"""

from __future__ import annotations

import datetime as dt
import functools
from dataclasses import dataclass

import psycopg
from psycopg import sql

from tracker.schema import qualified

DEAD_COUNT_CAP = 10_000  # dead rows counted up to this (a reason filter is a substring: no index helps)
UNFINISHED_EXACT = 10_000  # the overview counts open and closed batches exactly up to this
OVERVIEW_EXACT_ROWS = 10_000  # the overview counts the backlog exactly up to this, then shows the id span
VALUE_PREVIEW = 2048  # bytes of a dead row's value an inspect page shows


@dataclass
class BatchRow:
    id: int
    user_key: str | None
    state: str
    total: int
    pending: int
    failed: int
    created_at: dt.datetime
    last_activity_at: dt.datetime
    finished_at: dt.datetime | None
    outcome: str | None
    parent_id: int | None

    @property
    def acked(self) -> int:
        return self.total - self.pending - self.failed

    def percent(self, part: int) -> float:
        return 100.0 * part / self.total if self.total else 0.0

    @property
    def time_to_completion(self) -> float | None:
        return None if self.finished_at is None else (self.finished_at - self.created_at).total_seconds()


@dataclass
class BatchPage:
    rows: list[BatchRow]
    next_cursor: str | None  # the `before` of the next page; None: last page


_COLUMNS = (
    "id, user_key, state, total, pending, failed, created_at, last_activity_at, "
    "coalesce(completed_at, expired_at), outcome, parent_id"
)
# Another tenant's batches are not there for a tenant's token (the HTTP API's rule).
_TENANT = "coalesce(tenant, 'default') = %(tenant)s"


@functools.lru_cache(maxsize=32)
def _statements(schema: str) -> dict[str, sql.Composed]:
    b = qualified(schema, "batch")
    q = {
        "unfinished": f"SELECT {_COLUMNS} FROM {{b}} WHERE state IN ('open', 'closed') AND id < %(before)s "
        f"AND (%(state)s::text IS NULL OR state = %(state)s) AND {_TENANT} ORDER BY id DESC LIMIT %(limit)s",
        "finished": f"SELECT {_COLUMNS} FROM {{b}} WHERE state IN ('complete', 'expired') "
        "AND (coalesce(completed_at, expired_at), id) < (%(at)s, %(before)s) "
        f"AND {_TENANT} ORDER BY coalesce(completed_at, expired_at) DESC, id DESC LIMIT %(limit)s",
        "by_id": f"SELECT {_COLUMNS} FROM {{b}} WHERE id = %(id)s AND {_TENANT}",
        "by_key": f"SELECT {_COLUMNS} FROM {{b}} WHERE user_key = %(key)s AND {_TENANT} "
        "ORDER BY user_key DESC, id DESC LIMIT %(limit)s",
        "count_unfinished": "SELECT (SELECT count(*) FROM (SELECT 1 FROM {b} WHERE state IN ('open', 'closed') "
        f"AND {_TENANT} LIMIT %(cap)s) s), "
        # The index's entries are every tenant's: scaled by this tenant's share of the batch table
        # (ANALYZE's statistics), so a tenant learns nothing of the others' volume; none when unknown.
        "(SELECT (c.reltuples * (CASE WHEN %(tenant)s = 'default' THEN s.null_frac ELSE 0 END + coalesce("
        "(SELECT u.freq FROM unnest(s.most_common_vals::text::text[], s.most_common_freqs) u(val, freq) "
        "WHERE u.val = %(tenant)s), 0)))::int8 "
        "FROM pg_class c, pg_stats s WHERE c.oid = to_regclass(%(index)s) AND s.schemaname = %(schema)s "
        "AND s.tablename = 'batch' AND s.attname = 'tenant' AND NOT s.inherited)",
        "tenant_of": "SELECT coalesce(tenant, 'default') FROM {b} WHERE id = %(id)s",
        # The library may open a child of a tenant's batch: the tenant sees its own children only.
        "children": f"SELECT {_COLUMNS} FROM {{b}} WHERE parent_id = %(id)s AND id > %(after)s AND {_TENANT} "
        "ORDER BY id LIMIT %(limit)s",
    }
    return {k: sql.SQL(v).format(b=b) for k, v in q.items()}


def _rows(cur: psycopg.Cursor) -> list[BatchRow]:
    return [BatchRow(*r) for r in cur.fetchall()]


FAR = dt.datetime.max.replace(tzinfo=dt.UTC)
ID_CAP = 2**63 - 1


def batches(
    conn: psycopg.Connection, schema: str, tenant: str, *, view: str, cursor: str | None, limit: int
) -> BatchPage:
    """A page of `view` (unfinished, open, closed or finished) batches, newest first, after `cursor`."""
    q = _statements(schema)
    params: dict[str, object] = {"tenant": tenant, "limit": limit + 1}
    if view == "finished":
        at, _, before = (cursor or "").partition("~")
        params["at"] = dt.datetime.fromisoformat(at) if at else FAR
        params["before"] = int(before) if before else ID_CAP
        rows = _rows(conn.execute(q["finished"], params))
    else:
        params["before"] = int(cursor) if cursor else ID_CAP
        params["state"] = None if view == "unfinished" else view
        rows = _rows(conn.execute(q["unfinished"], params))
    conn.rollback()
    more, rows = len(rows) > limit, rows[:limit]
    if not more:
        return BatchPage(rows, None)
    last = rows[-1]
    nxt = f"{last.finished_at.isoformat()}~{last.id}" if view == "finished" and last.finished_at else str(last.id)
    return BatchPage(rows, nxt)


def search(conn: psycopg.Connection, schema: str, tenant: str, text: str, limit: int) -> list[BatchRow]:
    """Batches whose id is `text` (when it is a number) or whose user key is exactly `text`."""
    q = _statements(schema)
    found: list[BatchRow] = []
    if text.isascii() and text.isdigit() and len(text) <= 18:
        found += _rows(conn.execute(q["by_id"], {"id": int(text), "tenant": tenant}))
    found += [
        r for r in _rows(conn.execute(q["by_key"], {"key": text, "tenant": tenant, "limit": limit})) if r not in found
    ]
    conn.rollback()
    return found[:limit]


@dataclass
class Unfinished:
    """The overview's open and closed batches: exact up to UNFINISHED_EXACT, else more than that."""

    count: int | None  # None: not read (error)
    exact: bool = True
    estimate: int | None = None  # when not exact: the planner's estimate, if above the cap
    error: str | None = None


def count_unfinished_statement(schema: str, tenant: str) -> tuple[sql.Composed, dict[str, object]]:
    """The statement counting `tenant`'s open and closed batches up to UNFINISHED_EXACT + 1 (and an
    estimate of them from the planner's statistics), and its parameters."""
    index = qualified(schema, "batch_unfinished").as_string(None)
    params = {"tenant": tenant, "cap": UNFINISHED_EXACT + 1, "index": index, "schema": schema}
    return _statements(schema)["count_unfinished"], params


def unfinished_of(row: tuple[int, int | None]) -> Unfinished:
    counted, estimate = row
    if counted <= UNFINISHED_EXACT:
        return Unfinished(int(counted))
    return Unfinished(
        UNFINISHED_EXACT, False, estimate if estimate is not None and estimate > UNFINISHED_EXACT else None
    )


def tenant_of(conn: psycopg.Connection, schema: str, batch_id: int) -> str | None:
    row = conn.execute(_statements(schema)["tenant_of"], {"id": batch_id}).fetchone()
    conn.rollback()
    return None if row is None else str(row[0])


def children_statement(schema: str, tenant: str, batch_id: int, limit: int) -> tuple[sql.Composed, dict[str, object]]:
    """The first `limit` children of a batch (by id) that `tenant` sees, as BatchRow columns."""
    return _statements(schema)["children"], {"id": batch_id, "after": 0, "limit": limit, "tenant": tenant}


def children(conn: psycopg.Connection, schema: str, tenant: str, batch_id: int, limit: int) -> list[BatchRow]:
    rows = _rows(conn.execute(*children_statement(schema, tenant, batch_id, limit)))
    conn.rollback()
    return rows


@dataclass
class DeadDetail:
    id: int
    failed_at: dt.datetime
    created_at: dt.datetime
    topic: str
    partition: int | None
    key: bytes | None
    value: bytes | None  # the first VALUE_PREVIEW bytes
    value_bytes: int | None
    headers: list[tuple[str, bytes | None]]
    reason: str
    leader_id: str | None


def dead_row(conn: psycopg.Connection, schema: str, table: str, dead_id: int) -> DeadDetail | None:
    row = conn.execute(
        sql.SQL(
            "SELECT id, failed_at, created_at, topic, kafka_partition, key, substring(value FROM 1 FOR %s), "
            "length(value), header_keys, header_values, reason, leader_id::text FROM {} WHERE id = %s"
        ).format(qualified(schema, f"{table}_dead")),
        [VALUE_PREVIEW, dead_id],
    ).fetchone()
    conn.rollback()
    if row is None:
        return None
    keys, values = list(row[8] or []), list(row[9] or [])
    headers = [(k, bytes(v) if v is not None else None) for k, v in zip(keys, values, strict=False)]
    return DeadDetail(
        row[0], row[1], row[2], row[3], row[4], _bytes(row[5]), _bytes(row[6]), row[7], headers, row[10], row[11]
    )


def _bytes(v: bytes | memoryview | None) -> bytes | None:
    return None if v is None else bytes(v)
