"""The overview's database figures: each statement on its own (one failing statement shows an error
in its own panel, the rest render), all in one round trip; and bounded counts, exact up to a cap
and shown as more than the cap above it (real Postgres, through the real server)."""

from __future__ import annotations

import psycopg
import pytest
from support.console_server import cfg, client  # noqa: F401  (fixtures)
from support.http_server import TOKEN, RunningServer
from support.pg_trace import traced
from test_admin import add_dead

import tracker
from harvester.admin import status
from harvester.services.console import queries
from harvester.services.console.overview import Gatherer
from harvester.services.console.reads import read_each


def test_one_failing_statement_leaves_the_others_answered_in_one_round_trip(pg_dsn, tmp_path):
    statements = [
        ("SELECT %s::int, %s::text", [1, "a"]),
        ("SELECT 1 / 0", None),
        ("SELECT * FROM no_such_table_anywhere", None),
        ("SELECT '[1, 2]'::json", None),
        ("SELECT 1 WHERE false", None),
    ]
    got, trips = traced(pg_dsn, tmp_path, lambda conn: read_each(conn, statements), autocommit=True)
    assert got[0] == (1, "a") and got[3] == ([1, 2],) and got[4] == ()
    assert isinstance(got[1], psycopg.errors.DivisionByZero)
    assert isinstance(got[2], psycopg.errors.UndefinedTable) and "no_such_table_anywhere" in str(got[2])
    assert trips == 1, (tmp_path / "trace").read_text()


def test_a_locked_table_errors_its_own_panel_and_the_batches_still_count(cfg, pg_dsn, schema):  # noqa: F811
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        tracker.open_batch(conn, schema=schema)
    with psycopg.connect(pg_dsn) as holder, psycopg.connect(pg_dsn, options="-c lock_timeout=200") as conn:
        holder.execute(f'LOCK TABLE "{schema}".outbox IN ACCESS EXCLUSIVE MODE')
        tables, unfinished = Gatherer(cfg).database(conn)
        assert tables[0].status is None and "lock" in (tables[0].error or ""), tables
        assert unfinished.count == 1 and unfinished.error is None
        holder.rollback()
        holder.execute(f'LOCK TABLE "{schema}".batch IN ACCESS EXCLUSIVE MODE')
        tables, unfinished = Gatherer(cfg).database(conn)
        assert tables[0].status is not None and tables[0].error is None
        assert unfinished.count is None and "lock" in (unfinished.error or "")


def test_a_missing_table_shows_an_error_in_its_panel_and_the_page_still_renders(cfg, pg_dsn, schema):  # noqa: F811
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        tracker.open_batch(conn, schema=schema)
        conn.execute(f'DROP TABLE "{schema}".outbox_dead')
    with RunningServer(cfg, [TOKEN]) as server:
        page = client(server, TOKEN).get("/console/")
    assert page.status_code == 200, page.text
    assert "outbox_dead" in page.text and 'data-error="table"' in page.text, page.text
    assert 'data-figure="unfinished"><a href="/console/batches">1</a>' in page.text


def test_counts_are_exact_up_to_a_cap_and_more_than_it_above(cfg, pg_dsn, schema):  # noqa: F811
    cap = queries.UNFINISHED_EXACT
    assert cap <= 10_000
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            f'INSERT INTO "{schema}".batch (state, total, pending, created_at, last_activity_at) '
            "SELECT 'open', 0, 0, now(), now() FROM generate_series(1, %s)",
            [cap + 5],
        )
        conn.execute(f'ANALYZE "{schema}".batch')
    add_dead(pg_dsn, schema, "some-topic", 3, "too large")
    with psycopg.connect(pg_dsn) as conn:
        tables, unfinished = Gatherer(cfg).database(conn)
        st = status.unit_status(conn, schema, "outbox", dead_exact_up_to=2)
    assert (unfinished.count, unfinished.exact, unfinished.estimate) == (cap, False, cap + 5)
    # Another tenant's batches are in the same index: its estimate is its share, not everyone's.
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            f'INSERT INTO "{schema}".batch (state, total, pending, tenant) '
            "SELECT 'open', 0, 0, 'acme' FROM generate_series(1, %s)",
            [cap + 100],  # a table this small is analysed whole: the shares are exact
        )
        conn.execute(f'ANALYZE "{schema}".batch')
        default_count = queries.unfinished_of(
            conn.execute(*queries.count_unfinished_statement(schema, "default")).fetchone()
        )
        acme = queries.unfinished_of(conn.execute(*queries.count_unfinished_statement(schema, "acme")).fetchone())
        nobody = queries.unfinished_of(conn.execute(*queries.count_unfinished_statement(schema, "nobody")).fetchone())
    assert default_count.estimate is not None and abs(default_count.estimate - (cap + 5)) <= 2
    assert acme.estimate is not None and abs(acme.estimate - (cap + 100)) <= 2
    assert (nobody.count, nobody.exact, nobody.estimate) == (0, True, None)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"DELETE FROM \"{schema}\".batch WHERE tenant = 'acme'")
        conn.execute(f'ANALYZE "{schema}".batch')
    assert (st.dead_rows, st.dead_rows_capped) == (2, True)  # more than 2
    assert (tables[0].status.dead_rows, tables[0].status.dead_rows_capped) == (3, False)
    with RunningServer(cfg, [TOKEN]) as server:
        page = client(server, TOKEN).get("/console/").text
    assert f"more than {cap:,}" in page, page


@pytest.mark.parametrize("dead", [0, 4])
def test_outbox_status_json_keeps_dead_rows_an_int_and_says_when_it_is_capped(cfg, pg_dsn, schema, dead):  # noqa: F811
    if dead:
        add_dead(pg_dsn, schema, "some-topic", dead, "too large")
    with psycopg.connect(pg_dsn) as conn:
        st = status.unit_status(conn, schema, "outbox", dead_exact_up_to=3)
    d = st.__dict__
    assert isinstance(d["dead_rows"], int) and d["dead_rows_capped"] is (dead > 3)
    assert d["dead_rows"] == (3 if dead > 3 else dead)
