"""Orphans: expire batches idle too long, delete finished ones after the retention time.

Idle means no add, close or ack for `idle_expiry` seconds (`last_activity_at`). Both open and
closed batches expire: a closed batch whose acks stopped arriving is as orphaned as an open one
whose producer died, and without expiry it would never reach retention and never be deleted.
Complete batches are deleted `retention` seconds after completion, expired ones `retention`
seconds after expiry; their groups go with them (ON DELETE CASCADE).

Work is done in chunks of at most `chunk` batches per statement, each picking its rows with
FOR UPDATE SKIP LOCKED: several sweepers never wait on each other or on a batch an application
transaction holds (that batch is busy, hence not idle, and is looked at next time). Every chunk
commits on its own, which keeps locks short, when the connection is autocommit or was idle when
`sweep` was called (e.g. fresh from a pool); a connection already in a transaction is left to its
caller to commit.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import psycopg
from psycopg import pq, sql

from . import metrics
from .schema import check_identifier


@dataclass
class SweepResult:
    expired: int = 0
    deleted: int = 0


@functools.lru_cache(maxsize=64)
def _statements(schema: str) -> dict[str, str]:
    batch = sql.Identifier(schema, "batch")
    q = {
        "expire": sql.SQL(
            "WITH idle AS (SELECT id FROM {batch} WHERE state IN ('open', 'closed') "
            "AND last_activity_at < clock_timestamp() - make_interval(secs => %(idle)s) "
            "ORDER BY id LIMIT %(chunk)s FOR NO KEY UPDATE SKIP LOCKED) "
            "UPDATE {batch} b SET state = 'expired', expired_at = clock_timestamp() FROM idle "
            "WHERE b.id = idle.id RETURNING b.id"),
        "delete": sql.SQL(
            "WITH old AS (SELECT id FROM {batch} WHERE state IN ('complete', 'expired') "
            "AND coalesce(completed_at, expired_at) < clock_timestamp() - make_interval(secs => %(retention)s) "
            "ORDER BY coalesce(completed_at, expired_at) LIMIT %(chunk)s FOR UPDATE SKIP LOCKED) "
            "DELETE FROM {batch} b USING old WHERE b.id = old.id RETURNING b.id"),
    }
    return {k: v.format(batch=batch).as_string(None) for k, v in q.items()}


def sweep(conn: psycopg.Connection, *, schema: str, idle_expiry: float, retention: float, chunk: int = 1000,
          max_chunks: int | None = None) -> SweepResult:
    """Expire idle batches, then delete old finished ones, `chunk` at a time until none are left
    (or `max_chunks` statements of each kind ran). Returns how many of each."""
    check_identifier(schema, "schema")
    for name, value in (("idle_expiry", idle_expiry), ("retention", retention)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    q = _statements(schema)
    result = SweepResult()
    # A connection with no transaction open is ours to commit chunk by chunk.
    commit_chunks = not conn.autocommit and conn.info.transaction_status == pq.TransactionStatus.IDLE
    for kind, params in (("expire", {"idle": float(idle_expiry), "chunk": chunk}),
                         ("delete", {"retention": float(retention), "chunk": chunk})):
        rounds = 0
        while max_chunks is None or rounds < max_chunks:
            rounds += 1
            n = len(conn.execute(q[kind], params).fetchall())
            if commit_chunks:
                conn.commit()
            if kind == "expire":
                result.expired += n
                metrics.batches_expired.inc(n)
            else:
                result.deleted += n
            if n < chunk:
                break
    return result
