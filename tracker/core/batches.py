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

from psycopg import sql

from tracker import tracing
from tracker.core.steps import Op, Query, Round, one
from tracker.core.validate import check_count, check_thresholds, check_topic, check_user_key
from tracker.errors import BatchExpired, BatchNotOpen, DepthExceeded, InvalidArgument, ParentNotOpen, UnknownBatch
from tracker.ids import GROUP_BITS_MAX, ID_MAX, expand


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
        return expand(self.batch_id, self.group_id, self.upto)[self.start :]


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
    outcome: str | None = None  # when complete: "succeeded", or "failed" (an item or a child failed, or a threshold)
    failed: int = 0  # its own items that failed
    late: int = 0  # outcomes recorded after it finished (counted in succeeded/failed, changing no outcome)
    parent_id: int | None = None
    children_open: int = 0  # children not finished yet
    children: int = 0  # children opened under it
    children_failed: int = 0  # children folded in that finished failed or expired

    @property
    def complete(self) -> bool:
        return self.state == "complete"

    @property
    def succeeded(self) -> int:
        """Its own items that succeeded: pending + succeeded + failed = total."""
        return self.total - self.pending - self.failed


def batch_id_of(batch: Batch | int, name: str = "batch") -> int:
    # A Batch is a plain dataclass a caller may build by hand: its id is checked like a bare one.
    given = batch.id if isinstance(batch, Batch) else batch
    if isinstance(given, int) and not isinstance(given, bool) and 0 <= given <= ID_MAX:
        return given
    raise InvalidArgument(name, batch, f"a tracker Batch or a batch id (an int from 0 to {ID_MAX})")


def completion_insert(schema: str, outbox_table: str) -> sql.Composable:
    """`INSERT INTO outbox ... SELECT ... FROM finished`: one completion event per row of a CTE
    named `finished` whose column `whole` is the batch row as the completing statement left it.
    Takes one parameter, the default completion topic. The event itself (topic, key, JSON value,
    headers with the batch's opening span context) is the schema's `completion_event`
    (sql/R__events.sql), the one definition every completion path inserts."""
    return sql.SQL(
        "INSERT INTO {outbox} (topic, key, value, header_keys, header_values) "
        "SELECT e.* FROM finished f CROSS JOIN LATERAL {event}(f.whole, {topic}) e"
    ).format(
        outbox=sql.Identifier(schema, outbox_table),
        event=sql.Identifier(schema, "completion_event"),
        topic=sql.Placeholder(),
    )


def render(schema: str, outbox_table: str, q: dict[str, sql.SQL], **objects: str) -> dict[str, str]:
    """The statements `q` as text, with their names filled in: {batch} and {group} (the schema's
    tables), {outbox} (the outbox table as a regclass literal, for the SQL functions that take it),
    {insert} (completion_insert) and each of `objects` (name -> a function or table of the schema)."""
    names: dict[str, sql.Composable] = {
        "batch": sql.Identifier(schema, "batch"),
        "group": sql.Identifier(schema, "batch_group"),
        "outbox": sql.Literal(sql.Identifier(schema, outbox_table).as_string(None)),
        "insert": completion_insert(schema, outbox_table),
    }
    names.update((k, sql.Identifier(schema, v)) for k, v in objects.items())
    return {k: v.format(**names).as_string(None) for k, v in q.items()}


@functools.lru_cache(maxsize=64)
def statements(schema: str, outbox_table: str) -> dict[str, str]:
    q = {
        "open": sql.SQL("INSERT INTO {batch} (user_key, completion_topic) VALUES (%s, %s) RETURNING id, created_at"),
        # With an active span (tracker.tracing): its context, for the completion and expiry events.
        "open_traced": sql.SQL(
            "INSERT INTO {batch} (user_key, completion_topic, traceparent, tracestate) "
            "VALUES (%s, %s, %s, %s) RETURNING id, created_at"
        ),
        # A child: counted in its open parent (under the parent's row lock), one level deeper.
        "open_under": sql.SQL(
            "UPDATE {batch} SET children = children + 1, children_open = children_open + 1, "
            "last_activity_at = clock_timestamp() WHERE id = %s AND state = 'open' AND depth < %s RETURNING depth + 1"
        ),
        "parent": sql.SQL("SELECT state, depth FROM {batch} WHERE id = %s"),
        "open_full": sql.SQL(
            "INSERT INTO {batch} (user_key, completion_topic, traceparent, tracestate, parent_id, depth, "
            "tolerated_failures, tolerated_failure_ratio) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
            "RETURNING id, created_at"
        ),
        "lock": sql.SQL("SELECT state, next_group FROM {batch} WHERE id = %s FOR NO KEY UPDATE"),
        # Top up the batch's last group when an earlier add left it partly filled.
        "top_up": sql.SQL(
            "WITH last AS (SELECT size FROM {group} WHERE batch_id = %(b)s::int8 AND id = %(g)s::int8 "
            "AND size < %(max)s::int4) "
            "UPDATE {group} g SET size = last.size + k.n, pending = g.pending + k.n, "
            "bits = g.bits || repeat('1', k.n)::varbit "
            "FROM last, LATERAL (SELECT least(%(n)s::int4, %(max)s::int4 - last.size) AS n) k "
            "WHERE g.batch_id = %(b)s::int8 AND g.id = %(g)s::int8 RETURNING last.size, g.size"
        ),
        # New groups are made by the server: nothing proportional to the count is built here.
        "new_groups": sql.SQL(
            "INSERT INTO {group} (batch_id, id, size, pending, bits) "
            "SELECT %(b)s::int8, %(first)s::int8 + g, s.size, s.size, repeat('1', s.size)::varbit "
            "FROM generate_series(0::int8, %(count)s::int8 - 1) AS g, "
            "LATERAL (SELECT CASE WHEN g < %(full)s::int8 THEN %(max)s::int4 ELSE %(rest)s::int4 END AS size) AS s"
        ),
        "grow": sql.SQL(
            "UPDATE {batch} SET total = total + %(n)s::int8, pending = pending + %(n)s::int8, "
            "next_group = %(next)s::int8, last_activity_at = clock_timestamp() WHERE id = %(b)s::int8"
        ),
        "close": sql.SQL(
            "UPDATE {batch} SET state = 'closed', closed_at = clock_timestamp(), last_activity_at = clock_timestamp() "
            "WHERE id = %s AND state = 'open' RETURNING state"
        ),
        # What can finish now finishes (sql/R__outcomes.sql), with its one completion event.
        "finish": sql.SQL("SELECT {finish}(ARRAY[%s::int8], {outbox}::regclass, %s)"),
        # A close first folds the consumers' committed ack claims of the batch (waiting
        # for its row lock, as the close does anyway), so it decides completion on every ack
        # committed so far.
        "settle": sql.SQL("SELECT {settle}(%s, {outbox}::regclass, %s, true)"),
        "state": sql.SQL("SELECT state FROM {batch} WHERE id = %s"),
        "status": sql.SQL(
            # A complete batch without an outcome finished before outcomes existed: it succeeded.
            "SELECT state, total, pending, user_key, created_at, closed_at, completed_at, last_activity_at, expired_at, "
            "coalesce(outcome, CASE WHEN state = 'complete' THEN 'succeeded' END), failed, late, parent_id, "
            "children_open, children, children_failed FROM {batch} WHERE id = %s"
        ),
    }
    return render(schema, outbox_table, q, settle="ack_settle", finish="batch_finish")


# ---------------------------------------------------------------- operations (no I/O: see steps.py)


# The deepest a batch can be (0: no parent): batches nest at most 8 levels (sql/0016_outcomes.sql).
DEPTH_MAX = 7


def open_op(
    q: dict[str, str],
    user_key: object,
    completion_topic: object,
    parent: object = None,
    tolerated_failures: object = None,
    tolerated_failure_ratio: object = None,
) -> Op[Batch]:
    user_key = check_user_key(user_key)
    if completion_topic is not None:
        check_topic(completion_topic, "completion_topic")
    n, r = check_thresholds(tolerated_failures, tolerated_failure_ratio)
    parent_id = None if parent is None else batch_id_of(parent, "parent")  # type: ignore[arg-type]
    traceparent, tracestate = tracing.current()
    if parent_id is not None or n is not None or r is not None:
        depth = 0
        if parent_id is not None:
            (got,) = yield one(q["open_under"], [parent_id, DEPTH_MAX])
            if got is None:
                (found,) = yield one(q["parent"], [parent_id])
                if found is None:
                    raise UnknownBatch(parent_id, role="parent")
                if found[0] != "open":
                    raise ParentNotOpen(parent_id, found[0])
                raise DepthExceeded(parent_id, found[1], DEPTH_MAX)
            depth = got[0]
        params = [user_key, completion_topic, traceparent, tracestate, parent_id, depth, n, r]
        (row,) = yield one(q["open_full"], params, last=True)
        return Batch(row[0], user_key, completion_topic, row[1])  # type: ignore[arg-type]
    if traceparent is None:
        (row,) = yield one(q["open"], [user_key, completion_topic], last=True)
    else:
        (row,) = yield one(q["open_traced"], [user_key, completion_topic, traceparent, tracestate], last=True)
    batch_id, created_at = row
    return Batch(batch_id, user_key, completion_topic, created_at)  # type: ignore[arg-type]


def reserve_op(q: dict[str, str], batch_id: int, n: int, *, last: bool) -> Op[list[GroupHandle]]:
    """Track `n` more items in an open batch: top up its last group, then new groups of at most
    8192. `last`: nothing follows in the call (enqueue still writes its messages)."""
    (row,) = yield one(q["lock"], [batch_id], last=last and n == 0)
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
        (topped,) = yield one(q["top_up"], {"b": batch_id, "g": next_group - 1, "n": n, "max": GROUP_BITS_MAX})
        if topped is not None:
            old, new = topped
            handles.append(GroupHandle(batch_id, next_group - 1, new, old))
            left -= new - old
    first_new = next_group
    full, rest = divmod(left, GROUP_BITS_MAX)
    count = full + (1 if rest else 0)
    queries = []
    if count:
        queries.append(
            Query(
                q["new_groups"],
                {"b": batch_id, "first": first_new, "count": count, "full": full, "max": GROUP_BITS_MAX, "rest": rest},
            )
        )
        handles.extend(GroupHandle(batch_id, first_new + i, GROUP_BITS_MAX) for i in range(full))
        if rest:
            handles.append(GroupHandle(batch_id, first_new + full, rest))
    queries.append(Query(q["grow"], {"n": n, "next": next_group + count, "b": batch_id}))
    yield Round(tuple(queries), last)
    return handles


def add_op(q: dict[str, str], batch: Batch | int, n: object) -> Op[list[GroupHandle]]:
    batch_id = batch_id_of(batch)
    count = check_count(n)
    return (yield from reserve_op(q, batch_id, count, last=True))


def close_op(q: dict[str, str], batch: Batch | int, completion_topic: str) -> Op[tuple[bool, bool]]:
    """Returns (complete, closed_now): whether the batch is complete, and whether this call closed it."""
    batch_id = batch_id_of(batch)
    # Settle, close and, should the close change nothing, the state it found: one round trip.
    # Not the last round: the settle may have written, so an error raised below must undo it.
    _settled, closed, _finished, now = yield Round(
        (
            Query(q["settle"], [batch_id, completion_topic], "none"),
            Query(q["close"], [batch_id], "one"),
            Query(q["finish"], [batch_id, completion_topic], "none"),
            Query(q["state"], [batch_id], "one"),
        )
    )
    if closed is not None:
        return now is not None and now[0] == "complete", True
    if now is None:
        raise UnknownBatch(batch_id)
    if now[0] == "expired":
        raise BatchExpired(batch_id)
    return now[0] == "complete", False


def status_op(q: dict[str, str], batch: Batch | int) -> Op[BatchStatus]:
    batch_id = batch_id_of(batch)
    (row,) = yield one(q["status"], [batch_id], last=True)
    if row is None:
        raise UnknownBatch(batch_id)
    return BatchStatus(*row)
