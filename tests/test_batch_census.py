"""The batch census behind the `reaper_batches` gauge and `reaper outbox status`: exact for the live
work, exact for finished batches up to its cap, the planner's statistics above it, and never more
than cap + 1 finished rows read, however many retention keeps."""

from __future__ import annotations

import json

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harvester.batch_census import STATES, batch_census, census_statement

counts_of_states = st.fixed_dictionaries({s: st.integers(min_value=0, max_value=30) for s in STATES})


def fill(pg_dsn: str, schema: str, counts: dict[str, int], pending: int = 2) -> None:
    """`counts[state]` batches of each state; unfinished ones with `pending` of 5 items pending."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'TRUNCATE "{schema}".batch CASCADE')
        for state, n in counts.items():
            left = 0 if state in ("complete", "expired") else pending
            c.execute(
                f'INSERT INTO "{schema}".batch (state, total, pending) SELECT %s, 5, %s FROM generate_series(1, %s)',
                [state, left, n],
            )
        c.execute(f'ANALYZE "{schema}".batch')


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(counts=counts_of_states, cap=st.integers(min_value=0, max_value=70))
def test_counts_are_exact_up_to_the_cap_and_pending_items_always(pg_dsn, schema, counts, cap):
    fill(pg_dsn, schema, counts)
    with psycopg.connect(pg_dsn) as c:
        census = batch_census(c, schema, cap)
        assert c.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS  # the caller's, not ended
    assert census.items_pending == 2 * (counts["open"] + counts["closed"])
    finished = counts["complete"] + counts["expired"]
    if finished <= cap:
        assert census.counts == counts and not census.estimated
    else:
        assert census.estimated == {"complete", "expired"}
        assert {s: census.counts[s] for s in ("open", "closed")} == {s: counts[s] for s in ("open", "closed")}
        # A table this small is analysed whole: the statistics are the truth, unless a state is too
        # rare for the most-common-values list, when the sample's share of it is what is known.
        for s in ("complete", "expired"):
            assert census.counts[s] <= counts[s]
        assert sum(census.counts[s] for s in ("complete", "expired")) >= cap + 1


def test_above_the_cap_the_statistics_give_each_finished_state(pg_dsn, schema):
    counts = {"open": 3, "closed": 2, "complete": 400, "expired": 90}
    fill(pg_dsn, schema, counts)
    with psycopg.connect(pg_dsn) as c:
        census = batch_census(c, schema, 50)
    assert census.counts == counts and census.estimated == {"complete", "expired"}


def test_the_statement_reads_at_most_cap_plus_one_finished_batches(pg_dsn, schema):
    fill(pg_dsn, schema, {"open": 5, "closed": 5, "complete": 3000, "expired": 3000})
    statement, params = census_statement(schema, 100)
    with psycopg.connect(pg_dsn) as c:
        [[plan]] = c.execute(psycopg.sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) ") + statement, params).fetchall()

    def nodes(node):
        yield node
        for child in node.get("Plans", []):
            yield from nodes(child)

    plan = plan if isinstance(plan, list) else json.loads(plan)
    finished_reads = [
        n["Actual Rows"]
        for n in nodes(plan[0]["Plan"])
        if n["Node Type"] in ("Seq Scan", "Index Scan", "Bitmap Heap Scan", "Index Only Scan")
        and "complete" in n.get("Filter", n.get("Index Cond", n.get("Recheck Cond", "")))
    ]
    assert finished_reads and max(finished_reads) <= 101


def test_without_statistics_above_the_cap_the_finished_states_are_counted(pg_dsn, schema):
    """A batch table ANALYZE has not seen (never, or not since a TRUNCATE set reltuples to -1) has no
    statistics to estimate from: the finished states are counted, not taken from the sample, which
    holds only the first cap + 1 finished batches the scan met, all of one state here."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'ALTER TABLE "{schema}".batch SET (autovacuum_enabled = false)')  # no ANALYZE but ours
    counts = {"open": 1, "closed": 0, "complete": 60, "expired": 40}

    def insert_unanalysed() -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(f'TRUNCATE "{schema}".batch CASCADE')
            for state in ("complete", "expired", "open"):  # the scan meets every complete one first
                c.execute(
                    f'INSERT INTO "{schema}".batch (state, total, pending) SELECT %s, 5, 0 FROM generate_series(1, %s)',
                    [state, counts[state]],
                )

    insert_unanalysed()  # never analysed: pg_stats has no row
    with psycopg.connect(pg_dsn) as c:
        assert c.execute("SELECT count(*) FROM pg_stats WHERE schemaname = %s", [schema]).fetchone() == (0,)
        census = batch_census(c, schema, 50)
    assert census.counts == counts and not census.estimated
    fill(pg_dsn, schema, {"open": 0, "closed": 0, "complete": 5, "expired": 500})  # statistics of other times
    insert_unanalysed()  # reltuples is -1 again, pg_stats keeps what ANALYZE saw before the TRUNCATE
    with psycopg.connect(pg_dsn) as c:
        assert c.execute(
            "SELECT reltuples FROM pg_class WHERE oid = %s::regclass", [f'"{schema}".batch']
        ).fetchone() == (-1,)
        census = batch_census(c, schema, 50)
    assert census.counts == counts and not census.estimated


def test_a_batch_table_with_inheritance_children_has_one_estimate_per_state(pg_dsn, schema):
    """ANALYZE of a table with inheritance children keeps two rows of statistics per column (with and
    without the children): the estimates read the table's own, one per state, not an error."""
    from harvester.services.console import queries

    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'CREATE TABLE "{schema}".batch_archive () INHERITS ("{schema}".batch)')
    fill(pg_dsn, schema, {"open": 3, "closed": 2, "complete": 400, "expired": 90})
    with psycopg.connect(pg_dsn) as c:
        assert c.execute(
            "SELECT count(*) FROM pg_stats WHERE schemaname = %s AND tablename = 'batch' AND attname = 'state'",
            [schema],
        ).fetchone() == (2,)
        census = batch_census(c, schema, 50)
        counted, _ = c.execute(*queries.count_unfinished_statement(schema, "default")).fetchone()
    assert census.counts == {"open": 3, "closed": 2, "complete": 400, "expired": 90}
    assert counted == 5
