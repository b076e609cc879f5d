"""What the console costs the database, on real Postgres: its key queries read by index, the
overview reads a bounded part of a large outbox and all its database figures in one round trip."""

from __future__ import annotations

import psycopg
from support.console_server import cfg, client, server  # noqa: F401 (fixtures)
from support.http_server import TOKEN
from support.pg_trace import traced
from test_admin import add_dead

import tracker
from harvester.services.console import queries


def test_the_overview_reads_its_database_figures_in_one_round_trip(cfg, pg_dsn, schema, tmp_path):
    from harvester.services.console.overview import Gatherer

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            f'INSERT INTO "{schema}".outbox (topic, value) SELECT %s, %s FROM generate_series(1, 20)', ["t", b"v"]
        )
        conn.execute(
            f'UPDATE "{schema}".outbox SET leader_id = gen_random_uuid() WHERE id IN '
            f'(SELECT id FROM "{schema}".outbox ORDER BY id LIMIT 3)'
        )
        b = tracker.open_batch(conn, schema=schema)
    add_dead(pg_dsn, schema, "some-topic", 2, "too large")
    (tables, unfinished), trips = traced(pg_dsn, tmp_path, Gatherer(cfg).database)
    assert trips == 1, trips
    [t] = tables
    st = t.status
    assert st is not None and (st.backlog_rows, st.backlog_exact, st.in_flight_rows, st.dead_rows) == (20, True, 3, 2)
    assert len(st.marked_by) == 3 and st.oldest_age_seconds >= 0 and unfinished.count == 1, (st, b)


def test_the_key_queries_read_by_index(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            f'INSERT INTO "{schema}".batch (state, completed_at, user_key) SELECT '
            "CASE WHEN g % 10 = 0 THEN 'open' ELSE 'complete' END, "
            "CASE WHEN g % 10 = 0 THEN NULL ELSE now() - g * interval '1 s' END, 'k' || g "
            "FROM generate_series(1, 50000) g"
        )
        conn.execute(f'ANALYZE "{schema}".batch')
        q = queries._statements(schema)
        params = {
            "tenant": "default",
            "limit": 51,
            "before": 2**63 - 1,
            "state": None,
            "at": queries.FAR,
            "id": 5,
            "key": "k5",
            "cap": queries.UNFINISHED_EXACT + 1,
            "index": f"{schema}.batch_unfinished",
            "schema": schema,
            "after": 0,
        }
        for name in ("unfinished", "finished", "by_id", "by_key", "count_unfinished", "children"):
            plan = "\n".join(r[0] for r in conn.execute(psycopg.sql.SQL("EXPLAIN ") + q[name], params).fetchall())
            # The batch table is read by index; the tenant estimate's catalog lookups are a few rows.
            assert "Seq Scan on batch" not in plan, (name, plan)
        # A user key is found by its own index, however old the batch: not by reading the newest batches.
        plan = "\n".join(r[0] for r in conn.execute(psycopg.sql.SQL("EXPLAIN ") + q["by_key"], params).fetchall())
        assert "batch_user_key" in plan and "batch_pkey" not in plan, plan
        found = queries.search(conn, schema, "default", "k5", 10)
        assert [r.user_key for r in found] == ["k5"], found


def _outbox_rows_read(pg_dsn: str, schema: str) -> int:
    """Rows of the outbox read by any scan so far (the statistics every backend reports at idle)."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("SELECT pg_stat_clear_snapshot()")
        row = c.execute(
            "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables "
            "WHERE schemaname = %s AND relname = 'outbox'",
            [schema],
        ).fetchone()
    return int(row[0])


def test_the_overview_reads_a_bounded_part_of_a_large_outbox(server, cfg, pg_dsn, schema):
    from harvester.services.console.overview import Gatherer

    backlog = 300_000
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            f'INSERT INTO "{schema}".outbox (topic, value) SELECT %s, %s FROM generate_series(1, %s)',
            ["t", b"v", backlog],
        )
        # A leader's marks are at the head of the table (it marks the lowest ids).
        conn.execute(
            f'UPDATE "{schema}".outbox SET leader_id = gen_random_uuid() WHERE id IN '
            f'(SELECT id FROM "{schema}".outbox ORDER BY id LIMIT 7)'
        )
        conn.execute(f'VACUUM ANALYZE "{schema}".outbox')
        conn.execute("SELECT pg_stat_force_next_flush()")
    # What the page reads of the database, on a connection whose statistics are flushed at once.
    with psycopg.connect(pg_dsn) as conn:
        before = _outbox_rows_read(pg_dsn, schema)
        tables, _ = Gatherer(cfg).database(conn)
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.commit()
    read = _outbox_rows_read(pg_dsn, schema) - before
    assert tables[0].status is not None and tables[0].status.in_flight_rows == 7
    assert read <= 3 * queries.OVERVIEW_EXACT_ROWS, read  # not the 300,000 rows
    page = client(server, TOKEN).get("/console/")
    assert page.status_code == 200 and "In flight</dt><dd>7 rows" in page.text, page.text
    assert 'data-figure="backlog">300,000' in page.text and "≤" in page.text  # the id span, an upper bound
