"""Storage of failures stays bounded over time: a reason is kept only while a retained batch has an
item that failed under it. Retention (tracker.expiry.sweep) deletes finished batches, and with
them their failed items (group_failure cascades); the reason texts must go too, else a reason
that carries anything item-specific (an upstream error message, an id, a time) grows
failure_reason by one row per failure, forever."""

from __future__ import annotations

import psycopg

import tracker
from tracker.expiry import sweep


def test_retention_leaves_no_reason_that_no_retained_item_failed_under(pg_dsn, schema, conn):
    b = tracker.open_batch(conn, schema=schema)
    [g] = tracker.add_items(conn, b, 50, schema=schema)
    for i in range(50):  # item-specific reasons, as real error messages are
        tracker.fail(conn, [f"{b.id}:{g.group_id}:{i}"], f"HTTP 503 from upstream, request {i}", schema=schema)
    tracker.close_batch(conn, b, schema=schema)
    conn.commit()
    assert tracker.status(conn, b, schema=schema).state == "complete"
    conn.commit()
    with psycopg.connect(pg_dsn) as c:
        got = sweep(c, schema=schema, idle_expiry=3600, retention=0, registry=None)
        c.commit()
    assert got.deleted == 1
    (failed_items,) = conn.execute("SELECT count(*) FROM group_failure").fetchone()
    (reasons,) = conn.execute("SELECT count(*) FROM failure_reason").fetchone()
    assert (failed_items, reasons) == (0, 0)
