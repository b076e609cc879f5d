"""Settling: fold consumers' committed ack claims into bits, counts and completion.

Most claims are settled by their own transaction's commit (sql/0006_ack_claims.sql). A commit
that finds the batch row busy (another settle, the acker, an add or a close in progress) leaves
its claims committed, and they wait for the next settle of that batch. `settle()` is that next
settle, on demand; `Settler` runs it in a loop in the reaper (every `interval` seconds, in short
transactions of its own that never wait for a lock), which bounds how long a completion can lag
the commit of the batch's last ack.

Every settle runs `ack_settle` under the batch row lock, like every other writer of a batch's
groups, so the completion decision stays in exactly one transaction.
"""
from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import psycopg
import structlog
from psycopg import sql

from . import metrics
from .session import DEFAULTS, atomic, pg_connection, schema_of

log = structlog.get_logger("reaper.settler")


@dataclass
class SettleResult:
    acked: int = 0                                       # bits the settles cleared
    completed: list[int] = field(default_factory=list)   # batches they completed
    busy: list[int] = field(default_factory=list)        # batches whose row was locked elsewhere


@functools.lru_cache(maxsize=64)
def _statements(schema: str) -> dict[str, str]:
    q = {
        # Committed claims only (READ COMMITTED): in-flight ones settle at their own commit.
        "claimed": sql.SQL("SELECT DISTINCT batch_id FROM {claim} ORDER BY batch_id LIMIT %s"),
        # In batch-id order: with wait=true, two settles lock their batches in the same order.
        "settle": sql.SQL(
            "SELECT u.b, s.flipped, s.completed FROM unnest(%s::int8[]) WITH ORDINALITY AS u(b, n),"
            " LATERAL {settle}(u.b, %s::regclass, %s, %s) AS s ORDER BY u.n"),
    }
    names = {"claim": sql.Identifier(schema, "ack_claim"), "settle": sql.Identifier(schema, "ack_settle")}
    return {k: v.format(**names).as_string(None) for k, v in q.items()}


def statements(schema: str) -> dict[str, str]:
    return _statements(schema)


def settle(session: Any, batch_ids: Iterable[int] | None = None, *, schema: str | None = None, wait: bool = False,
           limit: int = 1000) -> SettleResult:
    """Settle committed claims of `batch_ids` (default: of up to `limit` batches that have any) in
    the caller's transaction. wait=False skips a batch whose row another transaction holds (it
    comes back in `busy`); wait=True waits for it."""
    schema = schema_of(schema)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ValueError(f"limit must be an int >= 1, got {limit!r}")
    conn = pg_connection(session)
    q = statements(schema)
    result = SettleResult()
    with atomic(conn):
        if batch_ids is None:
            ids = [b for (b,) in conn.execute(q["claimed"], [limit]).fetchall()]
        else:
            ids = sorted(set(batch_ids))
            for b in ids:
                if not isinstance(b, int) or isinstance(b, bool) or b < 0:
                    raise TypeError(f"batch ids must be ints >= 0, got {b!r}")
        if not ids:
            return result
        outbox = sql.Identifier(schema, DEFAULTS.outbox_table).as_string(None)
        rows = conn.execute(q["settle"], [ids, outbox, DEFAULTS.completion_topic, wait]).fetchall()
    for b, flipped, completed in rows:
        if flipped is None:
            result.busy.append(b)
            continue
        result.acked += flipped
        if completed:
            result.completed.append(b)
    metrics.batches_completed.inc(len(result.completed))
    return result


class Settler:
    """The reaper's settle loop: every `interval` seconds, settle every batch with committed claims
    in one short transaction that skips busy batches (they are tried again next time)."""

    def __init__(self, *, dsn: str, schema: str, interval: float = 0.01, limit: int = 1000) -> None:
        if not isinstance(interval, (int, float)) or isinstance(interval, bool) or interval <= 0:
            raise ValueError(f"interval must be a number of seconds > 0, got {interval!r}")
        self.dsn = dsn
        self.schema = schema_of(schema)
        self.interval = float(interval)
        self.limit = limit
        self.stats = {"passes": 0, "acked": 0, "completed": 0, "busy": 0, "errors": 0}

    def run(self, stop: threading.Event) -> None:
        conn: psycopg.Connection | None = None
        try:
            while not stop.is_set():
                try:
                    if conn is None or conn.closed or conn.broken:
                        conn = psycopg.connect(self.dsn, autocommit=True)
                    started = time.monotonic()
                    r = settle(conn, schema=self.schema, limit=self.limit)
                    self.stats["passes"] += 1
                    self.stats["acked"] += r.acked
                    self.stats["completed"] += len(r.completed)
                    self.stats["busy"] += len(r.busy)
                    if r.completed:
                        log.info("settled", acked=r.acked, completed=len(r.completed), busy=len(r.busy))
                    if r.busy:
                        metrics.settle_busy.inc(len(r.busy))
                    stop.wait(max(0.0, self.interval - (time.monotonic() - started)))
                except psycopg.Error as exc:
                    self.stats["errors"] += 1
                    log.warning("settle failed; retrying", error=str(exc), error_type=type(exc).__name__)
                    stop.wait(max(self.interval, 1.0))
        finally:
            if conn is not None:
                conn.close()
