"""Orphans: expire batches idle too long, delete finished ones after the retention time.

Idle means no add, close or ack for `idle_expiry` seconds (`last_activity_at`). Both open and
closed batches expire: a closed batch whose acks stopped arriving is as orphaned as an open one
whose producer died, and without expiry it would never reach retention and never be deleted.
Complete batches are deleted `retention` seconds after completion, expired ones `retention`
seconds after expiry; their groups go with them (ON DELETE CASCADE). A parent goes only once no
child of it is open. First, each sweep folds finished children into their parents (as a settle
does, tracker.settle), so a parent finishes, or expires when idle, even where no settler runs.

Expiry is an event: the statement that expires a batch also writes one *expiry event* into the
outbox (like the completion event: the same statement, so exactly once). It goes to
`expiry_topic` when set, else the batch's completion topic, else the default completion topic;
key = batch id, value = JSON with `"event": "expired"`, the user key, counts and the reason.
`expire_batch` expires one batch on an operator's request (`reaper batch expire`) the same way.

Work is done in chunks of at most `chunk` batches per statement, each picking its rows with
FOR UPDATE SKIP LOCKED: several sweepers never wait on each other or on a batch an application
transaction holds (that batch is busy, hence not idle, and is looked at next time). A batch a
racing sweeper expired first fails the state re-check under the row lock, so it is expired (and
announced) once. Every chunk commits on its own, which keeps locks short, when the connection is
autocommit or was idle when `sweep` was called (e.g. fresh from a pool); a connection already in
a transaction is left to its caller to commit.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass

import psycopg
from prometheus_client import REGISTRY, CollectorRegistry
from psycopg import pq, sql

from tracker import metrics
from tracker.config import DEFAULT_COMPLETION_TOPIC, DEFAULT_OUTBOX_TABLE
from tracker.core.steps import Op, one
from tracker.drivers import sync_psycopg as driver
from tracker.errors import TrackerError, UnknownBatch
from tracker.schema import check_identifier

EXPIRY_EVENT = "batch-expired"  # the `event` header of an expiry event (written by the schema's expiry_event)


@dataclass
class SweepResult:
    expired: int = 0
    deleted: int = 0
    completed: int = 0  # parents that finished when their finished children were folded in


@dataclass(frozen=True)
class Expired:
    """A batch `expire_batch` expired: its counts at expiry."""

    batch_id: int
    user_key: str | None
    total: int
    pending: int
    topic: str  # where its expiry event went


# The expiry itself, its event and its topic, in one statement around a CTE `pick` (ids, locked).
# The UPDATE re-checks the state: under READ COMMITTED it sees the row as its locker committed it.
_EXPIRE = """
expired AS (
  UPDATE {batch} b SET state = 'expired', expired_at = clock_timestamp() FROM pick
  WHERE b.id = pick.id AND b.state IN ('open', 'closed')
  RETURNING b.id, b.user_key, b.total, b.pending, b AS whole,
            coalesce(%(expiry_topic)s, b.completion_topic, %(default_topic)s) AS topic),
event AS (
  INSERT INTO {outbox} (topic, key, value, header_keys, header_values)
  SELECT ev.* FROM expired e CROSS JOIN LATERAL {expiry_event}(e.whole, e.topic, %(reason)s, %(detail)s::jsonb) ev
  ORDER BY e.id)
SELECT id, user_key, total, pending, topic FROM expired"""


@functools.lru_cache(maxsize=64)
def _statements(schema: str, outbox_table: str) -> dict[str, str]:
    names = {
        "batch": sql.Identifier(schema, "batch"),
        "outbox": sql.Identifier(schema, outbox_table),
        "expiry_event": sql.Identifier(schema, "expiry_event"),  # the event itself: sql/R__events.sql
        "finish": sql.Identifier(schema, "batch_finish"),  # sql/R__outcomes.sql
        "child": sql.Identifier(schema, "child_finished"),
        "fold_fn": sql.Identifier(schema, "batch_fold"),
        "forget": sql.Identifier(schema, "failure_reasons_forget"),  # sql/R__outcomes.sql
        "group_failure": sql.Identifier(schema, "group_failure"),
        "settle": sql.Identifier(schema, "ack_settle"),  # sql/R__ack_claims.sql
        "claim": sql.Identifier(schema, "ack_claim"),
        "outbox_name": sql.Literal(sql.Identifier(schema, outbox_table).as_string(None)),
    }
    q = {
        # A batch with open children is not idle: it waits for them (they expire first when idle,
        # and each expired child, once folded in, counts as activity of its parent). Children before parents
        # (descending ids), as every path that locks several batches.
        "expire_pick": sql.SQL(
            "SELECT id FROM {batch} WHERE state IN ('open', 'closed') AND children_open = 0 "
            "AND last_activity_at < clock_timestamp() - make_interval(secs => %(idle)s) "
            "ORDER BY id DESC LIMIT %(chunk)s FOR NO KEY UPDATE SKIP LOCKED"
        ),
        # Under those locks, settle the committed claims first (acks are activity; the last one
        # completes the batch), so no committed ack is reported pending by an expiry. A claim still
        # in flight is not waited for (claims lock no batch row: consumers never wait on each other
        # or on the sweeper); if it commits after the expiry, its settle drops it (ack_settle).
        "expire_settle": sql.SQL(
            "SELECT count(*) FILTER (WHERE s.completed) "
            "FROM (SELECT u.b FROM unnest(%(ids)s::int8[]) AS u(b) "
            "WHERE EXISTS (SELECT 1 FROM {claim} c WHERE c.batch_id = u.b)) AS p, "
            "LATERAL {settle}(p.b, {outbox_name}::regclass, %(default_topic)s, true) AS s"
        ),
        # The picked batches still idle after their settle (the row locks are this transaction's).
        "expire": sql.SQL(
            "WITH pick AS (SELECT id FROM {batch} WHERE id = ANY(%(ids)s::int8[]) "
            "AND last_activity_at < clock_timestamp() - make_interval(secs => %(idle)s)), " + _EXPIRE
        ),
        # An expired child leaves its roll-up for its parent (the schema's trigger
        # batch_child_finished, in the expiring statement; the parent's row is never locked), which
        # folds it in under its own row lock at its next close, ack or settle, or at this fold: an
        # expired child counts as finished and failed (its pending items failed) for its parent.
        # The fold finishes what can (batch_finish), so a parent finishes or, idle, expires even
        # where no settler runs. Parents a transaction holds are skipped (folded by that holder or
        # next time); descending ids, as every path that locks several batches.
        "fold": sql.SQL(
            "WITH p AS (SELECT b.id FROM {batch} b WHERE b.id IN (SELECT f.parent_id FROM {child} f) "
            "ORDER BY b.id DESC LIMIT %(chunk)s FOR NO KEY UPDATE SKIP LOCKED) "
            "SELECT coalesce(cardinality({finish}(array_agg(p.id ORDER BY p.id DESC), {outbox_name}::regclass, "
            "%(default_topic)s)), 0), count(*) FROM p"
        ),
        # An operator's expiry waits for the row lock: a busy batch is expired once its holder is done.
        # It first folds in the children that finished before it (not yet folded), so its expiry
        # event, and the roll-up it leaves for its own parent, count them (batch_fold).
        # Committed claims are settled first, as the sweeper's are.
        "fold_one": sql.SQL("SELECT {fold_fn}(b.id) FROM (SELECT id FROM {batch} WHERE id = %s FOR NO KEY UPDATE) b"),
        "settle_one": sql.SQL(
            "SELECT {settle}(%(id)s, {outbox_name}::regclass, %(default_topic)s, true) "
            "WHERE EXISTS (SELECT 1 FROM {claim} WHERE batch_id = %(id)s)"
        ),
        "expire_one": sql.SQL("WITH pick AS (SELECT id FROM {batch} WHERE id = %(id)s FOR NO KEY UPDATE), " + _EXPIRE),
        "state": sql.SQL("SELECT state FROM {batch} WHERE id = %s"),
        # Not a parent with a child still open (finished early or expired before it): the child's
        # row for it would wait for the deletion while the deletion waits for the child's row (its
        # parent_id set to null), a deadlock with the child's final ack. It goes once they are done.
        "delete": sql.SQL(
            "WITH old AS (SELECT id FROM {batch} WHERE state IN ('complete', 'expired') AND children_open = 0 "
            "AND coalesce(completed_at, expired_at) < clock_timestamp() - make_interval(secs => %(retention)s) "
            "ORDER BY coalesce(completed_at, expired_at) LIMIT %(chunk)s FOR UPDATE SKIP LOCKED), "
            "gone AS (DELETE FROM {batch} b USING old WHERE b.id = old.id RETURNING b.id) "
            # With each batch, the reasons its failed items had (read before the cascade deletes them).
            "SELECT gone.id, ARRAY(SELECT DISTINCT f.reason_id FROM {group_failure} f WHERE f.batch_id = gone.id) "
            "FROM gone"
        ),
        # Those reasons that no retained item failed under go too (sql/R__outcomes.sql).
        "forget": sql.SQL("SELECT {forget}(%s::int8[])"),
    }
    return {k: v.format(**names).as_string(None) for k, v in q.items()}


def _topics(
    outbox_table: str | None, completion_topic: str | None, expiry_topic: str | None
) -> tuple[str, str, str | None]:
    table = check_identifier(DEFAULT_OUTBOX_TABLE if outbox_table is None else outbox_table, "outbox table")
    default = DEFAULT_COMPLETION_TOPIC if completion_topic is None else completion_topic
    for name, value in (("completion_topic", default), ("expiry_topic", expiry_topic)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return table, default, expiry_topic


def sweep(
    conn: psycopg.Connection,
    *,
    schema: str,
    idle_expiry: float,
    retention: float,
    chunk: int = 1000,
    max_chunks: int | None = None,
    outbox_table: str | None = None,
    completion_topic: str | None = None,
    expiry_topic: str | None = None,
    registry: CollectorRegistry | None = REGISTRY,
    metrics_prefix: str = metrics.DEFAULT_PREFIX,
) -> SweepResult:
    """Fold finished children into their parents (which may finish them: one completion event
    each), expire idle batches (one expiry event each), then delete old finished ones, `chunk` at a
    time until none are left (or `max_chunks` statements of each kind ran), and with them the
    failure reasons that no retained item failed under. Returns how many batches of each.

    `outbox_table` and `completion_topic` default to the default tracker's ("outbox",
    "batch-completions"); `expiry_topic` (None: each batch's completion topic) is where expiry events go.
    Expired batches are counted in `<metrics_prefix>_batches_expired_total` of `registry` (None: not counted).
    """
    check_identifier(schema, "schema")
    table, default_topic, expiry_topic = _topics(outbox_table, completion_topic, expiry_topic)
    for name, value in (("idle_expiry", idle_expiry), ("retention", retention)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    q = _statements(schema, table)
    expired = metrics.for_registry(registry, metrics_prefix).batches_expired.labels(schema) if registry else None
    result = SweepResult()
    # A connection with no transaction open is ours: each chunk is a transaction of its own,
    # committed. In the caller's open transaction the whole sweep is one savepoint of it: a failure
    # undoes the sweep alone and leaves the caller's transaction usable, as every other call does.
    in_callers = not conn.autocommit and conn.info.transaction_status != pq.TransactionStatus.IDLE
    expire = {
        "idle": float(idle_expiry),
        "chunk": chunk,
        "expiry_topic": expiry_topic,
        "default_topic": default_topic,
        "reason": "idle",
        "detail": json.dumps({"idle_expiry_seconds": float(idle_expiry)}),
    }
    fold = {"chunk": chunk, "default_topic": default_topic}
    completed = metrics.for_registry(registry, metrics_prefix).batches_completed.labels(schema) if registry else None
    kinds = (("fold", fold), ("expire", expire), ("delete", {"retention": float(retention), "chunk": chunk}))
    # Counted once what they count is committed: after each chunk's own transaction, or in the
    # caller's transaction once the sweep's savepoint is released (a failed sweep counts nothing).
    counted = SweepResult()  # what of `result` the metrics have

    def count() -> None:
        for counter, now, before in (
            (completed, result.completed, counted.completed),
            (expired, result.expired, counted.expired),
        ):
            if counter is not None and now > before:
                counter.inc(now - before)
        counted.completed, counted.expired = result.completed, result.expired

    with conn.transaction() if in_callers else contextlib.nullcontext():
        for kind, params in kinds:
            rounds = 0
            while max_chunks is None or rounds < max_chunks:
                if not in_callers:
                    count()  # the chunks before this one are committed
                rounds += 1
                # Every row the expiry's CTE picked is locked by it and still open or closed (the lock
                # re-checks the state), so it expires all it picked: fewer than `chunk` means done.
                with contextlib.nullcontext() if in_callers else conn.transaction():
                    if kind == "expire":
                        rows, picked, finished = _expire_chunk(conn, q, expire)
                        result.completed += finished
                    else:
                        rows = conn.execute(q[kind], params).fetchall()
                    reasons = sorted({r for row in rows for r in row[1]}) if kind == "delete" else []
                    if reasons:
                        conn.execute(q["forget"], [reasons])
                if kind == "fold":
                    [(finished, n)] = rows
                    result.completed += finished
                    if n < chunk and not finished:  # a parent that finished may have left a row for its own
                        break
                    continue
                n = len(rows)
                if kind == "expire":
                    result.expired += n
                    n = picked  # those settled into activity or completion are not picked again
                else:
                    result.deleted += n
                if n < chunk:
                    break
    count()
    return result


def _expire_chunk(conn: psycopg.Connection, q: dict[str, str], params: Mapping[str, object]) -> tuple[list, int, int]:
    """One chunk of idle batches locked, their committed claims settled, the still idle expired:
    (rows expired, batches picked, batches the settle completed)."""
    ids = [i for (i,) in conn.execute(q["expire_pick"], params).fetchall()]
    if not ids:
        return [], 0, 0
    at = {**params, "ids": ids}
    row = conn.execute(q["expire_settle"], at).fetchone()
    finished = int(row[0]) if row else 0
    return conn.execute(q["expire"], at).fetchall(), len(ids), finished


class BatchNotExpirable(TrackerError, ValueError):
    """Expiring a batch that is already complete."""

    def __init__(self, batch_id: int, state: str) -> None:
        self.batch_id, self.state = batch_id, state
        super().__init__(f"batch {batch_id} is {state}: only open or closed batches can be expired")


def expire_batch(
    conn: psycopg.Connection,
    batch_id: int,
    *,
    schema: str,
    reason: str = "operator",
    note: str | None = None,
    outbox_table: str | None = None,
    completion_topic: str | None = None,
    expiry_topic: str | None = None,
    registry: CollectorRegistry | None = REGISTRY,
    metrics_prefix: str = metrics.DEFAULT_PREFIX,
) -> Expired | None:
    """Expire one open or closed batch now (its children that finished before it folded in first,
    so its event counts them) and write its expiry event, in the caller's transaction
    (never committed or rolled back here; see tracker.drivers.sync_psycopg). Returns None if it was already expired; raises
    UnknownBatch or BatchNotExpirable (a complete batch) and then changes nothing."""
    if not isinstance(batch_id, int) or isinstance(batch_id, bool) or batch_id < 0:
        raise ValueError(f"batch id must be an int >= 0, got {batch_id!r}")
    check_identifier(schema, "schema")
    table, default_topic, expiry_topic = _topics(outbox_table, completion_topic, expiry_topic)
    if not isinstance(reason, str) or not reason or (note is not None and not isinstance(note, str)):
        raise ValueError(f"reason must be a non-empty string and note a string or None, got {reason!r}, {note!r}")
    q = _statements(schema, table)
    params = {
        "id": batch_id,
        "expiry_topic": expiry_topic,
        "default_topic": default_topic,
        "reason": reason,
        "detail": json.dumps({"note": note} if note else {}),
    }
    got = driver.run(conn, _expire_op(q, params, batch_id))
    if got is not None and registry is not None:
        metrics.for_registry(registry, metrics_prefix).batches_expired.labels(schema).inc()
    return got


def _expire_op(q: dict[str, str], params: Mapping[str, object], batch_id: int) -> Op[Expired | None]:
    """The expiry as core steps: the caller-transaction rules of tracker.drivers.sync_psycopg apply (a savepoint
    in an open transaction, a transaction of its own on an idle autocommit connection)."""
    yield one(q["fold_one"], [batch_id])
    yield one(q["settle_one"], params)
    [row] = yield one(q["expire_one"], params)
    if row is not None:  # a child left its row for its parent in that statement (see "fold")
        return Expired(*row)
    [state] = yield one(q["state"], [batch_id])
    if state is None:
        raise UnknownBatch(batch_id)
    if state[0] == "expired":
        return None
    raise BatchNotExpirable(batch_id, state[0])
