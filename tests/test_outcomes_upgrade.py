"""A writer of the previous release still running after the upgrade (not yet redeployed) completes
batches with its own statement: state 'complete', no outcome, and the completion event built from
the row it updated. The row and the event still get an outcome."""

from __future__ import annotations

import json

import tracker


def test_a_batch_completed_by_a_writer_of_the_previous_release_has_an_outcome(conn, schema):
    ok = tracker.open_batch(conn, schema=schema)
    tracker.add_items(conn, ok, 1, schema=schema)
    bad = tracker.open_batch(conn, schema=schema)
    [g] = tracker.add_items(conn, bad, 2, schema=schema)
    tracker.fail(conn, f"{bad.id}:{g.group_id}:0", "gave up", schema=schema)
    tracker.close_batch(conn, ok, schema=schema)
    tracker.close_batch(conn, bad, schema=schema)
    conn.commit()
    # The previous release's masked ack, as it completes a closed batch (commit c4a30f3): clear
    # the bits, lower pending, complete it and write completion_event of the updated row.
    rows = conn.execute(
        "WITH g AS (UPDATE batch_group SET bits = bits & ~bits, pending = 0 WHERE batch_id = ANY(%s) "
        "RETURNING batch_id, pending), "
        "b AS (UPDATE batch b SET pending = 0, last_activity_at = clock_timestamp(), "
        "state = CASE WHEN b.state = 'closed' THEN 'complete' ELSE b.state END, "
        "completed_at = CASE WHEN b.state = 'closed' THEN clock_timestamp() ELSE b.completed_at END "
        "WHERE b.id = ANY(%s) RETURNING b.id, b AS whole) "
        "SELECT b.id, convert_from(e.value, 'UTF8') FROM b CROSS JOIN LATERAL completion_event(b.whole, 'c') e "
        "ORDER BY b.id",
        [[ok.id, bad.id], [ok.id, bad.id]],
    ).fetchall()
    conn.commit()
    assert [(i, json.loads(v)["outcome"]) for i, v in rows] == [(ok.id, "succeeded"), (bad.id, "failed")]
    assert tracker.status(conn, ok, schema=schema).outcome == "succeeded"
    assert tracker.status(conn, bad, schema=schema).outcome == "failed"
