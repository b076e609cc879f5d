"""A writer of the previous release still running after the upgrade (not yet redeployed) completes
batches with its own statement: state 'complete', no outcome, and the completion event built from
the row it updated. The row and the event still get an outcome. A batch finished before the
upgrade has none stored, and reads as succeeded."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import psycopg
import pytest
from support.history import sql_at
from support.teardown import drop_schema

import tracker
from tracker import schema as schema_mod

OLD_CHAIN = "c4a30f3"  # the chain before outcomes (tests/test_migrations.py)


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


def test_a_batch_finished_before_the_upgrade_reads_as_succeeded_and_no_table_is_rewritten(pg_dsn, tmp_path):
    """0016 stores no outcome in the batches finished before it (an UPDATE of each would rewrite the
    table under its ACCESS EXCLUSIVE lock): they read as succeeded everywhere, and neither batch
    nor batch_group is rewritten (same relfilenode before and after)."""
    old_sql = sql_at(OLD_CHAIN, tmp_path)
    name = f"t_{uuid.uuid4().hex[:12]}"
    schema_mod.migrate(pg_dsn, name, old_sql)
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(f'SET search_path TO "{name}"')
            (done,) = c.execute("SELECT open_batch()").fetchone()
            c.execute("SELECT * FROM add_items(%s, 3)", [done])
            c.execute("SELECT * FROM ack(ARRAY[%s])", [f"{done}:0:0-2"])
            assert c.execute("SELECT close_batch(%s)", [done]).fetchone() == (True,)
            (still_open,) = c.execute("SELECT open_batch()").fetchone()
            files = "SELECT pg_relation_filenode('batch'), pg_relation_filenode('batch_group')"
            before = c.execute(files).fetchone()
            schema_mod.migrate(pg_dsn, name)
            assert c.execute(files).fetchone() == before
            assert c.execute("SELECT outcome FROM batch WHERE id = %s", [done]).fetchone() == (None,)
            assert c.execute("SELECT state, outcome, succeeded, failed FROM batch_status(%s)", [done]).fetchone() == (
                "complete",
                "succeeded",
                3,
                0,
            )
            assert c.execute("SELECT outcome FROM batch_status(%s)", [still_open]).fetchone() == (None,)
            assert tracker.status(c, done, schema=name).outcome == "succeeded"
            assert tracker.status(c, still_open, schema=name).outcome is None
            # The checks added NOT VALID hold for rows written from now on.
            with pytest.raises(psycopg.errors.CheckViolation):
                c.execute("UPDATE batch SET failed = 4 WHERE id = %s", [done])
    finally:
        drop_schema(pg_dsn, name)
