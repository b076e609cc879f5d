"""Batches by state, for the gauges (every `metrics.backlog_interval`) and `reaper outbox status`,
read at a cost that does not grow with the finished batches retention keeps (a week by default:
millions at a steady rate, which a plain `count(*) ... GROUP BY state` would scan every time).

- open and closed batches, the live work, and their pending items: exact, through the
  `batch_unfinished` partial index;
- complete and expired ones: exact while there are at most FINISHED_EXACT of them together;
  above that the planner's statistics (the state's `pg_stats` frequency times the table's
  `reltuples`, refreshed by autovacuum's ANALYZE), never less than a sample of FINISHED_EXACT + 1
  finished batches held of that state. Without statistics (a table ANALYZE has not seen, or
  `reltuples` -1 since a TRUNCATE) there is nothing to estimate from, and they are counted, as
  before: the sample holds only the first finished batches the scan met, perhaps of one state.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from tracker.schema import qualified

FINISHED_EXACT = 100_000
STATES = ("open", "closed", "complete", "expired")


@dataclass(frozen=True)
class BatchCensus:
    counts: dict[str, int]  # state -> batches
    estimated: frozenset[str]  # states whose count is the planner's estimate (complete and expired, or none)
    items_pending: int  # items not yet acknowledged or failed in open and closed batches


def census_statement(schema: str, cap: int = FINISHED_EXACT) -> tuple[sql.Composed, dict[str, object]]:
    """One statement: rows of (state, what the row is, batches, pending items or NULL), where what the
    row is: 'live' (open and closed, counted), 'sample' (finished, counted among at most `cap` + 1 in
    all), 'stats' (the planner's estimate, of a state its statistics know) or 'all' (finished, counted,
    only when there are no statistics)."""
    b = qualified(schema, "batch")
    # the statistics of the state column, as long as the table's size is known (-1 after a TRUNCATE)
    stats_from = sql.SQL("FROM pg_class c, pg_stats s")
    stats_where = sql.SQL(
        "c.oid = %(table)s::regclass AND c.reltuples >= 0 "
        "AND s.schemaname = %(schema)s AND s.tablename = 'batch' AND s.attname = 'state' AND NOT s.inherited"
    )
    statement = sql.SQL(
        "SELECT state, 'live', count(*)::float8, coalesce(sum(pending), 0) FROM {b} "
        "WHERE state IN ('open', 'closed') GROUP BY state "
        "UNION ALL "
        "SELECT f.state, 'sample', count(*), NULL "
        "FROM (SELECT state FROM {b} WHERE state IN ('complete', 'expired') LIMIT %(cap)s) f GROUP BY f.state "
        "UNION ALL "
        "SELECT u.val, 'stats', c.reltuples * u.freq, NULL {stats_from}, "
        "unnest(s.most_common_vals::text::text[], s.most_common_freqs) u(val, freq) "
        "WHERE {stats_where} AND u.val IN ('complete', 'expired') "
        "UNION ALL "
        # read only when there is nothing to estimate from (a one-time filter before the scan)
        "SELECT state, 'all', count(*), NULL FROM {b} WHERE state IN ('complete', 'expired') "
        "AND NOT EXISTS (SELECT 1 {stats_from} WHERE {stats_where}) GROUP BY state"
    ).format(b=b, stats_from=stats_from, stats_where=stats_where)
    return statement, {"cap": cap + 1, "table": b.as_string(None), "schema": schema}


def census_of(rows: list[tuple[str, str, float | None, int | None]], cap: int = FINISHED_EXACT) -> BatchCensus:
    counts = dict.fromkeys(STATES, 0)
    got: dict[str, dict[str, float]] = {"live": {}, "sample": {}, "stats": {}, "all": {}}
    pending = 0
    for state, kind, n, items in rows:
        if n is not None:
            got[kind][state] = n
        pending += int(items or 0)
    finished = ("complete", "expired")
    for state in ("open", "closed"):
        counts[state] = int(got["live"].get(state, 0))
    # All counted: by the sample below its cap, or by the whole table without statistics (its rows
    # come only then, and there are finished batches when the sample reaches its cap).
    exact = got["sample"] if sum(got["sample"].values()) <= cap else got["all"] or None
    if exact is not None:
        return BatchCensus(counts | {s: int(exact.get(s, 0)) for s in finished}, frozenset(), pending)
    # The sample stopped at its cap: each finished state is at least what the sample held of it.
    for state in finished:
        counts[state] = max(int(got["sample"].get(state, 0)), round(got["stats"].get(state, 0.0)))
    return BatchCensus(counts, frozenset(finished), pending)


def batch_census(conn: psycopg.Connection, schema: str, cap: int = FINISHED_EXACT) -> BatchCensus:
    """The census of `schema`'s batches, in `conn`'s transaction (read only; never ends it)."""
    statement, params = census_statement(schema, cap)
    return census_of(conn.execute(statement, params).fetchall(), cap)


__all__ = ["BatchCensus", "FINISHED_EXACT", "batch_census", "census_of", "census_statement"]
