"""Batches: open, add items (groups of at most 8192 bits), close, status, and the completion event.

Locking: every writer locks the batch row first (adds, closes, acks in batch-id order, the
sweeper with SKIP LOCKED) and only then touches that batch's groups. Adds therefore serialise
with closes, a close serialises with the last ack, and the transaction that makes
`state = 'closed' and pending = 0` true is the only one that sees it become true: it sets
`complete` and writes the single completion event.

Storage: `batch_group` uses fillfactor 100, which packs 7 full groups per 8 KiB page: 1.19 bits
per tracked item with its primary key at 10M items (1.31 at 1M, where the btree's two fixed
pages weigh; 1.18 marginal). At fillfactor 70 only 5 fit: ~1.6-1.77 bits per item, over the
1.2 target. Measured (`python -m bench.tracker`, 1M items acked in 20 passes of 50k random ids,
each pass updating every group once in one transaction, PG 15, shared 2-core machine):

    fillfactor  at rest  largest, no vacuum  largest, vacuum each pass  HOT share of group updates
    100         1.31     22.7                5.9 (3.3 in another run)   4-7%
    70          1.77      4.0                2.9                        93-95%
    80-92       1.38      7.3                -                          78%

and with acks arriving for a minute (100 polls of 10k ids, 0.6 s apart, autovacuum on with this
migration's settings; `--churn`) the table settles at ~14 bits per item at fillfactor 100 (4
autovacuums) and ~6.4 at 70 (none needed).

Why HOT fails at 100: a row that does not fit beside its page's other live rows moves to a page
that fillfactor 100 packs full again, so it moves at every update, and nothing reuses the freed
space until VACUUM records it. Fillfactor 100 is kept because it meets the storage target in the
state most tracked items spend their life (pending, at rest, or complete until retention), and
`batch_group` gets a per-table autovacuum by count (1000 dead versions, no cost delay) that bounds
the growth while acks run. The price is paid by the groups being acked right now: non-HOT updates
(an index entry and a full ~1.1 KB row in WAL each) and a working set about twice the size it
would have at 70. Where that matters more than the resting size, fillfactor 70
(`ALTER TABLE batch_group SET (fillfactor = 70)`, for pages written from then on) keeps updates
HOT and the table within ~4-6 bits per item even without vacuum.
"""
from __future__ import annotations

import datetime as dt
import functools
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from . import metrics
from .errors import BatchExpired, BatchNotOpen, UnknownBatch
from .ids import GROUP_BITS_MAX, expand
from .session import DEFAULTS, atomic, pg_connection, schema_of
from .settler import statements as settle_statements


@dataclass(frozen=True)
class Batch:
    id: int
    user_key: str | None = None
    completion_topic: str | None = None
    created_at: dt.datetime | None = None


@dataclass(frozen=True)
class GroupHandle:
    """Items `start`..`upto - 1` of group `group_id` (start is 0 unless the add topped up a group
    an earlier add had left partly filled). Clients expand it into item ids themselves."""

    batch_id: int
    group_id: int
    upto: int
    start: int = 0

    @property
    def count(self) -> int:
        return self.upto - self.start

    @property
    def item_ids(self) -> list[str]:
        return expand(self.batch_id, self.group_id, self.upto)[self.start:]


@dataclass(frozen=True)
class BatchStatus:
    state: str
    total: int
    pending: int
    user_key: str | None
    created_at: dt.datetime
    closed_at: dt.datetime | None
    completed_at: dt.datetime | None
    last_activity_at: dt.datetime
    expired_at: dt.datetime | None = None

    @property
    def complete(self) -> bool:
        return self.state == "complete"


def batch_id_of(batch: Batch | int) -> int:
    if isinstance(batch, Batch):
        return batch.id
    if isinstance(batch, int) and not isinstance(batch, bool) and batch >= 0:
        return batch
    raise TypeError(f"expected a tracker Batch or a batch id (int >= 0), got {batch!r}")


def completion_insert(schema: str, outbox_table: str) -> sql.Composable:
    """`INSERT INTO outbox ... SELECT ... FROM finished`: one completion event per row of a CTE
    named `finished` (id, user_key, total, created_at, closed_at, completed_at, completion_topic).
    Takes one parameter, the default completion topic."""
    return sql.SQL(
        "INSERT INTO {outbox} (topic, key, value, header_keys, header_values) "
        "SELECT coalesce(f.completion_topic, {topic}), convert_to(f.id::text, 'UTF8'), "
        "convert_to(json_build_object('batch_id', f.id, 'user_key', f.user_key, 'total', f.total, "
        "'opened_at', f.created_at, 'closed_at', f.closed_at, 'completed_at', f.completed_at)::text, 'UTF8'), "
        "ARRAY['batch-id'], ARRAY[convert_to(f.id::text, 'UTF8')] FROM finished f"
    ).format(outbox=sql.Identifier(schema, outbox_table), topic=sql.Placeholder())


@functools.lru_cache(maxsize=64)
def _statements(schema: str, outbox_table: str) -> dict[str, str]:
    t = {"batch": sql.Identifier(schema, "batch"), "group": sql.Identifier(schema, "batch_group")}
    q = {
        "open": sql.SQL("INSERT INTO {batch} (user_key, completion_topic) VALUES (%s, %s) RETURNING id, created_at"),
        "lock": sql.SQL("SELECT state, next_group FROM {batch} WHERE id = %s FOR NO KEY UPDATE"),
        # Top up the batch's last group when an earlier add left it partly filled.
        "top_up": sql.SQL(
            "WITH last AS (SELECT size FROM {group} WHERE batch_id = %(b)s AND id = %(g)s AND size < %(max)s) "
            "UPDATE {group} g SET size = last.size + k.n, pending = g.pending + k.n, "
            "bits = g.bits || repeat('1', k.n)::varbit "
            "FROM last, LATERAL (SELECT least(%(n)s, %(max)s - last.size) AS n) k "
            "WHERE g.batch_id = %(b)s AND g.id = %(g)s RETURNING last.size, g.size"),
        "grow": sql.SQL(
            "UPDATE {batch} SET total = total + %(n)s, pending = pending + %(n)s, next_group = %(next)s, "
            "last_activity_at = clock_timestamp() WHERE id = %(b)s"),
        "copy_groups": sql.SQL("COPY {group} (batch_id, id, size, pending, bits) FROM STDIN (FORMAT BINARY)"),
        "close": sql.SQL(
            "WITH closed AS (UPDATE {batch} SET state = CASE WHEN pending = 0 THEN 'complete' ELSE 'closed' END, "
            "closed_at = clock_timestamp(), completed_at = CASE WHEN pending = 0 THEN clock_timestamp() END, "
            "last_activity_at = clock_timestamp() WHERE id = %s AND state = 'open' "
            "RETURNING id, state, user_key, total, created_at, closed_at, completed_at, completion_topic), "
            "finished AS (SELECT * FROM closed WHERE state = 'complete'), "
            "event AS ({insert}) SELECT state FROM closed"),
        "state": sql.SQL("SELECT state FROM {batch} WHERE id = %s"),
        "status": sql.SQL(
            "SELECT state, total, pending, user_key, created_at, closed_at, completed_at, last_activity_at, expired_at "
            "FROM {batch} WHERE id = %s"),
    }
    insert = completion_insert(schema, outbox_table)
    return {k: v.format(insert=insert, **t).as_string(None) for k, v in q.items()}


def statements(schema: str) -> dict[str, str]:
    return _statements(schema, DEFAULTS.outbox_table)


def open_batch(session: Any, *, user_key: str | None = None, completion_topic: str | None = None,
               schema: str | None = None) -> Batch:
    """Open a batch. Items are added by `outbox.enqueue` or `add_items`; `close_batch` closes it."""
    if user_key is not None and not isinstance(user_key, str):
        raise TypeError(f"user_key must be a str or None, got {type(user_key).__name__}")
    if user_key is not None and "\x00" in user_key:
        raise ValueError(f"user_key {user_key!r} contains a NUL character, which Postgres text cannot hold")
    if completion_topic is not None and (not isinstance(completion_topic, str) or not completion_topic):
        raise ValueError(f"completion_topic must be a non-empty string or None, got {completion_topic!r}")
    conn = pg_connection(session)
    q = statements(schema_of(schema))
    with atomic(conn):
        batch_id, created_at = conn.execute(q["open"], [user_key, completion_topic]).fetchone()
    metrics.batches_opened.inc()
    return Batch(batch_id, user_key, completion_topic, created_at)


def _ones(size: int) -> bytes:
    full, rest = divmod(size, 8)
    return b"\xff" * full + (bytes([(0xFF00 >> rest) & 0xFF]) if rest else b"")


def reserve(conn: psycopg.Connection, schema: str, batch_id: int, n: int) -> list[GroupHandle]:
    """Track `n` more items in an open batch: top up its last group, then new groups of at most
    8192. The caller runs this inside `atomic()` (enqueue writes its messages in the same block)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"the number of items to add must be an int >= 0, got {n!r}")
    q = statements(schema)
    row = conn.execute(q["lock"], [batch_id]).fetchone()
    if row is None:
        raise UnknownBatch(batch_id)
    state, next_group = row
    if state != "open":
        raise BatchNotOpen(batch_id, state)
    handles: list[GroupHandle] = []
    if n == 0:
        return handles
    left = n
    if next_group > 0:
        topped = conn.execute(q["top_up"], {"b": batch_id, "g": next_group - 1, "n": n, "max": GROUP_BITS_MAX}).fetchone()
        if topped is not None:
            old, new = topped
            handles.append(GroupHandle(batch_id, next_group - 1, new, old))
            left -= new - old
    first_new = next_group
    if left:
        sizes = [GROUP_BITS_MAX] * (left // GROUP_BITS_MAX)
        if left % GROUP_BITS_MAX:
            sizes.append(left % GROUP_BITS_MAX)
        with conn.cursor().copy(q["copy_groups"]) as copy:
            buf = bytearray(b"PGCOPY\n\xff\r\n\0" + bytes(8))
            for i, size in enumerate(sizes):
                bits = _ones(size)
                # 5 fields: int8 batch_id, int8 id, int4 size, int4 pending, varbit (int4 bit length + bytes)
                buf += b"\x00\x05\x00\x00\x00\x08" + (batch_id).to_bytes(8, "big", signed=True)
                buf += b"\x00\x00\x00\x08" + (first_new + i).to_bytes(8, "big", signed=True)
                buf += b"\x00\x00\x00\x04" + size.to_bytes(4, "big") + b"\x00\x00\x00\x04" + size.to_bytes(4, "big")
                buf += (4 + len(bits)).to_bytes(4, "big") + size.to_bytes(4, "big") + bits
            buf += b"\xff\xff"
            copy.write(buf)
        handles.extend(GroupHandle(batch_id, first_new + i, size) for i, size in enumerate(sizes))
        next_group += len(sizes)
    conn.execute(q["grow"], {"n": n, "next": next_group, "b": batch_id})
    return handles


def add_items(session: Any, batch: Batch | int, n: int, *, schema: str | None = None) -> list[GroupHandle]:
    """Track `n` items without writing messages (for producers that publish elsewhere)."""
    batch_id = batch_id_of(batch)
    conn = pg_connection(session)
    with atomic(conn):
        return reserve(conn, schema_of(schema), batch_id, n)


def close_batch(session: Any, batch: Batch | int, *, schema: str | None = None) -> bool:
    """Close the batch: no more items. Returns whether it is complete (now or already).

    Closing a closed or complete batch changes nothing; closing an expired one raises BatchExpired.
    """
    batch_id = batch_id_of(batch)
    conn = pg_connection(session)
    q = statements(schema_of(schema))
    with atomic(conn):
        # First fold the consumers' committed ack claims (tracker.acks.claim_masks) under the
        # batch row lock, so that the close decides completion on every ack committed so far.
        schema_name = schema_of(schema)
        outbox = sql.Identifier(schema_name, DEFAULTS.outbox_table).as_string(None)
        conn.execute(settle_statements(schema_name)["settle"], [[batch_id], outbox, DEFAULTS.completion_topic, True])
        row = conn.execute(q["close"], [batch_id, DEFAULTS.completion_topic]).fetchone()
        if row is None:
            now = conn.execute(q["state"], [batch_id]).fetchone()
            if now is None:
                raise UnknownBatch(batch_id)
            if now[0] == "expired":
                raise BatchExpired(batch_id)
            return now[0] == "complete"
    metrics.batches_closed.inc()
    if row[0] == "complete":
        metrics.batches_completed.inc()
        return True
    return False


def status(session: Any, batch: Batch | int, *, schema: str | None = None) -> BatchStatus:
    batch_id = batch_id_of(batch)
    conn = pg_connection(session)
    row = conn.execute(statements(schema_of(schema))["status"], [batch_id]).fetchone()
    if row is None:
        raise UnknownBatch(batch_id)
    return BatchStatus(*row)
