"""A consumer whose transaction runs `SET CONSTRAINTS ALL IMMEDIATE` (as applications with deferred
foreign keys do, to see their errors early) fires the claim's commit-time settle inside the call.
It used to run before the call read the item's bit: the claim's own settle cleared it, a first ack
read as a duplicate, and `exactly_once` skipped the effect for good (redeliveries too)."""

from __future__ import annotations

import psycopg
import pytest
from support.acking import closed_batch

import tracker


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_first_ack_counts_once_and_its_effect_runs_once_with_immediate_constraints(pg_dsn, schema, when):
    b, (h,) = closed_batch(pg_dsn, schema, 3)
    ids = list(h.item_ids)
    ran: list[str] = []
    t = tracker.Tracker(schema=schema, registry=None)
    with psycopg.connect(pg_dsn) as conn:
        if when == "before":
            conn.execute("SET CONSTRAINTS ALL IMMEDIATE")
        done = t.exactly_once(conn, ids[0], lambda s: ran.append(ids[0]) or "effect")
        assert done.first_time and done.value == "effect" and ran == [ids[0]], done
        acked = t.ack(conn, ids[1:])
        assert (acked.acked, acked.duplicates) == (2, 0), acked
        if when == "after":
            conn.execute("SET CONSTRAINTS ALL IMMEDIATE")  # the pending settles fire here
        conn.commit()
        again = t.exactly_once(conn, ids[0], lambda s: ran.append("again"))  # a redelivery
        assert not again.first_time and ran == [ids[0]]
        conn.commit()
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        tracker.settle(c, schema=schema, registry=None)
        row = c.execute(f'SELECT state, pending FROM "{schema}".batch WHERE id = %s', [b.id]).fetchone()
    assert row == ("complete", 0)
