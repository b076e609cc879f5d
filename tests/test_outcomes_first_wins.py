"""The first outcome committed for an item wins, whichever path gives it: an ack is a claim until
its settle (at its commit, or later when the batch row was busy then, always later under
REPEATABLE READ), and a failure (tracker.fail, the SQL fail(), fail_masks, Spark's outcomes, the
acker's '!' entries: all the masked path) settles the batch's committed claims before it reads any
bit. A failure of an item whose ack came first is a duplicate; the batch ends succeeded."""

from __future__ import annotations

import json

import hypothesis.strategies as st
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings

import tracker


def _batch(conn: psycopg.Connection, schema: str, n: int) -> tuple[tracker.Batch, int]:
    b = tracker.open_batch(conn, schema=schema)
    (g,) = tracker.add_items(conn, b, n, schema=schema)
    tracker.close_batch(conn, b, schema=schema)
    conn.commit()
    return b, g.group_id


def test_an_ack_then_a_failure_in_one_transaction_the_failure_is_a_duplicate(conn, schema):
    b, g = _batch(conn, schema, 2)
    assert tracker.ack(conn, f"{b.id}:{g}:0", schema=schema).acked == 1
    f = tracker.fail(conn, f"{b.id}:{g}:0", "gave up", schema=schema)
    conn.commit()
    assert (f.failed, f.duplicates) == (0, 1)
    tracker.ack(conn, f"{b.id}:{g}:1", schema=schema)
    conn.commit()
    s = tracker.status(conn, b, schema=schema)
    assert (s.state, s.outcome, s.failed, s.succeeded) == ("complete", "succeeded", 0, 2), s


def _ack_left_for_the_next_settle(pg_dsn: str, schema: str, items: str, isolation: str) -> None:
    """Commit an ack whose commit-time settle cannot run: REPEATABLE READ never settles at commit;
    READ COMMITTED skips it while another writer (the acker, an add, Spark) holds the batch row."""
    batch_id = int(items.split(":")[0])
    with psycopg.connect(pg_dsn) as holder, psycopg.connect(pg_dsn) as consumer:
        holder.execute(f'SELECT 1 FROM "{schema}".batch WHERE id = %s FOR NO KEY UPDATE', [batch_id])
        consumer.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
        assert tracker.ack(consumer, items, schema=schema).acked > 0
        consumer.commit()
        holder.rollback()
    with psycopg.connect(pg_dsn) as c:  # the claim is committed and not folded in
        (claims,) = c.execute(f'SELECT count(*) FROM "{schema}".ack_claim WHERE batch_id = %s', [batch_id]).fetchone()
    assert claims > 0


@pytest.mark.parametrize("isolation", ["READ COMMITTED", "REPEATABLE READ"])
@pytest.mark.parametrize("path", ["tracker.fail", "sql fail()", "sql fail_masks()"])
def test_a_failure_after_a_committed_unsettled_ack_is_a_duplicate(pg_dsn, conn, schema, isolation, path):
    b, g = _batch(conn, schema, 2)
    _ack_left_for_the_next_settle(pg_dsn, schema, f"{b.id}:{g}:0-1", isolation)
    item = f"{b.id}:{g}:0"
    if path == "tracker.fail":
        f = tracker.fail(conn, item, "redelivery failed", schema=schema)
        failed, duplicates = f.failed, f.duplicates
    elif path == "sql fail()":
        failed, duplicates, _ = conn.execute(
            "SELECT * FROM fail(ARRAY[%s], %s)", [item, "redelivery failed"]
        ).fetchone()
    else:
        row = conn.execute(  # item 0 of the group: the mask's first bit
            "SELECT * FROM fail_masks(ARRAY[%s]::bigint[], ARRAY[%s]::bigint[], ARRAY['80'], %s)",
            [b.id, g, "redelivery failed"],
        ).fetchone()
        failed, duplicates = row[0], 1 - row[0]
    conn.commit()
    assert (failed, duplicates) == (0, 1), path
    s = tracker.status(conn, b, schema=schema)
    assert (s.state, s.outcome, s.failed, s.succeeded) == ("complete", "succeeded", 0, 2), s
    events = conn.execute("SELECT count(*) FROM outbox WHERE key = %s", [str(b.id).encode()]).fetchone()
    assert events == (1,)


# Outcome calls in any order within ONE transaction, on items 0..5 of one batch: the first outcome
# of an item is the one kept, whichever call gave it.
CALLS = st.lists(
    st.tuples(
        st.sampled_from(["ack", "exactly_once", "masked ack", "fail", "close"]),
        st.lists(st.integers(0, 5), min_size=1, max_size=3),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=150, suppress_health_check=list(HealthCheck), deadline=None)
@given(calls=CALLS, tolerated=st.none() | st.integers(0, 2))
def test_calls_in_one_transaction_keep_each_items_first_outcome(conn, schema, calls, tolerated):
    b = tracker.open_batch(conn, schema=schema, tolerated_failures=tolerated)
    (g,) = tracker.add_items(conn, b, 6, schema=schema)
    conn.commit()
    first: dict[int, str] = {}  # item -> "ok" / "failed"
    closed = False
    for kind, items in calls:
        ids = [f"{b.id}:{g.group_id}:{i}" for i in items]
        if kind == "ack":
            tracker.ack(conn, ids, schema=schema)
        elif kind == "exactly_once":
            tracker.exactly_once(conn, ids[0], lambda session: None, schema=schema)
            items = items[:1]
        elif kind == "masked ack":
            tracker.ack(conn, ids, schema=schema, claims=False)
        elif kind == "fail":
            tracker.fail(conn, ids, "r", schema=schema)
        else:
            tracker.close_batch(conn, b, schema=schema)
            closed = True
            continue
        for i in items:
            first.setdefault(i, "failed" if kind == "fail" else "ok")
    conn.commit()
    s = tracker.status(conn, b, schema=schema)
    failed = sum(1 for v in first.values() if v == "failed")
    pending = 6 - len(first)
    assert (s.failed, s.pending) == (failed, pending), (calls, s, first)
    finishes = (closed and pending == 0) or (tolerated is not None and failed > tolerated)
    assert s.complete == finishes, (calls, s)
    events = conn.execute("SELECT value FROM outbox WHERE key = %s", [str(b.id).encode()]).fetchall()
    assert len(events) == (1 if finishes else 0)
    if events:
        assert json.loads(events[0][0])["outcome"] == ("failed" if failed or pending else "succeeded"), calls
    conn.commit()
