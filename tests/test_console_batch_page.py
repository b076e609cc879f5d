"""A batch's page reads the database in a few round trips, whatever it shows (the batch, its
groups, children, failures and pending items), on real Postgres."""

from __future__ import annotations

import psycopg
import pytest
from test_console import _round_trips

import tracker
from harvester.services.console import batch_page
from tracker.ids import parse_item_id


def _traced(pg_dsn, tmp_path, fn):
    trace = tmp_path / "trace"
    with psycopg.connect(pg_dsn, prepare_threshold=None) as conn, trace.open("w") as f:
        conn.pgconn.trace(f.fileno())
        conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS | psycopg.pq.Trace.REGRESS_MODE)
        got = fn(conn)
        conn.pgconn.untrace()
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    return got, _round_trips(trace.read_text())


@pytest.fixture
def family(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:
        parent = tracker.open_batch(conn, user_key="family", schema=schema)
        tracker.add_items(conn, parent, 20_000, schema=schema)  # 3 groups
        tracker.ack(conn, [f"{parent.id}:0:0-99"], schema=schema, claims=False)
        tracker.fail(conn, [f"{parent.id}:0:100", f"{parent.id}:1:5"], "image missing", schema=schema)
        kids = [tracker.open_batch(conn, parent=parent, schema=schema).id for _ in range(3)]
    return parent.id, kids


def test_a_batch_page_reads_in_at_most_two_round_trips(pg_dsn, schema, tmp_path, family):
    batch_id, kids = family
    got, trips = _traced(
        pg_dsn,
        tmp_path,
        lambda c: batch_page.read(c, schema, "default", batch_id, after=None, failures_after=None, limit=3),
    )
    assert got is not None
    view, children = got
    assert [c.id for c in children] == kids and view.children == 3
    assert view.failures == [
        {"item_id": f"{batch_id}:0:100", "reason": "image missing"},
        {"item_id": f"{batch_id}:1:5", "reason": "image missing"},
    ]
    assert view.pending_runs == [f"{batch_id}:0:101-8191", f"{batch_id}:1:0-4", f"{batch_id}:1:6-8191"]
    assert view.next_after == f"{batch_id}:1:8191" and view.failures_next is None
    assert (view.total, view.pending, view.failed, view.groups, view.groups_pending) == (20_000, 19_898, 2, 3, 3)
    assert trips <= 2, trips  # it was 15 or so: one per read, plus a rollback after each


def test_the_next_pages_and_an_unknown_or_foreign_batch_read_as_few(pg_dsn, schema, tmp_path, family):
    batch_id, _ = family
    after, fafter = parse_item_id(f"{batch_id}:1:8191"), parse_item_id(f"{batch_id}:0:100")
    got, trips = _traced(
        pg_dsn,
        tmp_path,
        lambda c: batch_page.read(c, schema, "default", batch_id, after=after, failures_after=fafter, limit=3),
    )
    assert got is not None and trips <= 2, trips
    view, _ = got
    assert view.pending_runs == [f"{batch_id}:2:0-{20_000 - 2 * 8192 - 1}"] and view.next_after is None
    assert view.failures == [{"item_id": f"{batch_id}:1:5", "reason": "image missing"}]
    for tenant, bid in (("default", 987654321), ("billing", batch_id)):
        got, trips = _traced(
            pg_dsn,
            tmp_path,
            lambda c: batch_page.read(c, schema, tenant, bid, after=None, failures_after=None, limit=3),
        )
        assert got is None and trips <= 2, (tenant, trips)


def test_a_failures_cursor_of_another_batch_is_a_bad_cursor(pg_dsn, schema, family):
    batch_id, kids = family
    with psycopg.connect(pg_dsn) as conn:
        with pytest.raises(batch_page.BadCursor):
            batch_page.read(
                conn, schema, "default", batch_id, after=None, failures_after=parse_item_id(f"{kids[0]}:0:1"), limit=3
            )
        assert conn.execute("SELECT 1").fetchone() == (1,)  # the connection is still usable
