"""Issue 12: deterministic interleavings of consumer claims, the settler and stale snapshots
(the random races are in test_ack_concurrency.py)."""

from __future__ import annotations

import json
import threading
import time

import psycopg
import pytest
from test_tracker_support import invariant_violations

import tracker
from harvester.services.claim_settler import ClaimSettler
from tracker.settle import settle


def _closed(conn: psycopg.Connection, schema: str, n: int):
    b = tracker.open_batch(conn, schema=schema)
    (h,) = tracker.add_items(conn, b, n, schema=schema)
    tracker.close_batch(conn, b, schema=schema)
    conn.commit()
    return b, h


def _events(conn: psycopg.Connection, schema: str, batch_id: int) -> int:
    return conn.execute(
        f'SELECT count(*) FROM "{schema}".outbox WHERE topic = %s AND key = %s',
        ["batch-completions", str(batch_id).encode()],
    ).fetchone()[0]


def test_a_commit_that_finds_the_batch_busy_leaves_its_claim_to_the_settler(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn, psycopg.connect(pg_dsn) as holder:
        b, h = _closed(conn, schema, 2)
        holder.execute(f'SELECT 1 FROM "{schema}".batch WHERE id = %s FOR NO KEY UPDATE', [b.id])
        r = tracker.ack(conn, h.item_ids, schema=schema)
        conn.commit()  # does not wait for the holder
        assert (r.acked, r.duplicates) == (2, 0)
        st = tracker.status(conn, b, schema=schema)
        assert (st.state, st.pending) == ("closed", 2)  # committed as claims, not settled yet
        # a redelivery sees the committed claim: nothing new
        assert tracker.ack(conn, h.item_ids[:1], schema=schema).acked == 0
        conn.commit()
        assert settle(conn, schema=schema).busy == [b.id]  # still held: skipped, not waited for
        conn.commit()
        holder.rollback()
        stop = threading.Event()
        settler = ClaimSettler(dsn=pg_dsn, schema=schema, interval=0.005)
        t = threading.Thread(target=settler.run, args=(stop,), daemon=True)
        t.start()
        try:
            deadline = time.monotonic() + 30
            while tracker.status(conn, b, schema=schema).state != "complete":
                conn.rollback()
                assert time.monotonic() < deadline, "the settler did not complete the batch"
                time.sleep(0.01)
        finally:
            stop.set()
            t.join(10)
        assert settler.stats["completed"] == 1 and settler.stats["acked"] == 2
        assert _events(conn, schema, b.id) == 1
        # the settle's completion event has the close's and the acker's shape
        ((value, keys, values),) = conn.execute(
            f'SELECT value, header_keys, header_values FROM "{schema}".outbox WHERE key = %s', [str(b.id).encode()]
        ).fetchall()
        event = json.loads(value)
        assert (event["batch_id"], event["total"], sorted(event)) == (
            b.id,
            2,
            sorted(
                ["batch_id", "closed_at", "completed_at", "opened_at", "total", "user_key"]  # version 1
                + ["event", "schema_version", "outcome", "succeeded", "failed", "pending", "parent_id"]
                + ["children", "rollup"]
            ),
        )
        assert (event["schema_version"], event["outcome"], event["succeeded"]) == (2, "succeeded", 2)
        assert (keys, values) == (["batch-id"], [str(b.id).encode()])
        assert conn.execute(f'SELECT count(*) FROM "{schema}".ack_claim').fetchone()[0] == 0
        assert invariant_violations(conn, schema) == []


def test_a_stale_repeatable_read_snapshot_never_runs_an_effect_twice(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn, psycopg.connect(pg_dsn) as late:
        b, h = _closed(conn, schema, 1)
        item = h.item_ids[0]
        late.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        late.execute("SELECT 1")  # its snapshot is taken now, before the first consumer commits
        ran = []
        assert tracker.exactly_once(conn, item, lambda s: ran.append("first"), schema=schema).first_time
        conn.commit()  # settled at commit: bit clear, claim gone
        assert tracker.status(conn, b, schema=schema).state == "complete"
        with pytest.raises(psycopg.errors.SerializationFailure):
            tracker.exactly_once(late, item, lambda s: ran.append("stale"), schema=schema)
        late.rollback()
        again = tracker.exactly_once(late, item, lambda s: ran.append("retry"), schema=schema)
        late.commit()
        assert not again.first_time and ran == ["first"]
        assert _events(conn, schema, b.id) == 1


def test_repeatable_read_claims_are_settled_later_and_counted_once(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn, psycopg.connect(pg_dsn) as rr:
        b, h = _closed(conn, schema, 3)
        rr.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        assert tracker.ack(rr, h.item_ids[:2], schema=schema).acked == 2
        rr.commit()  # REPEATABLE READ does not settle at commit
        assert tracker.status(conn, b, schema=schema).pending == 3
        conn.commit()
        # a READ COMMITTED ack of the last item settles the whole batch at its commit
        r = tracker.ack(conn, h.item_ids, schema=schema)
        assert (r.acked, r.duplicates) == (1, 2)
        conn.commit()
        st = tracker.status(conn, b, schema=schema)
        assert (st.state, st.pending) == ("complete", 0) and _events(conn, schema, b.id) == 1
        assert invariant_violations(conn, schema) == []
