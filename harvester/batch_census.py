"""Batches by state, for the gauges (every `metrics.backlog_interval`) and `reaper outbox status`,
read at a cost that does not grow with the finished batches retention keeps (a week by default:
millions at a steady rate, which a plain `count(*) ... GROUP BY state` would scan every time).

- open and closed batches, the live work, and their pending items: exact, through the
  `batch_unfinished` partial index;
- complete and expired ones: exact while there are at most FINISHED_EXACT of them together;
  above that the planner's statistics (the state's `pg_stats` frequency times the table's
  `reltuples`, refreshed by autovacuum's ANALYZE), never less than a sample of FINISHED_EXACT + 1
  finished batches held of that state.
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
    """One statement: rows of (state, batches counted or NULL, pending items or NULL, the planner's
    estimate or NULL). The finished batches counted are at most `cap` + 1 in all."""
    b = qualified(schema, "batch")
    statement = sql.SQL(
        "SELECT state, count(*), coalesce(sum(pending), 0), NULL::float8 FROM {b} "
        "WHERE state IN ('open', 'closed') GROUP BY state "
        "UNION ALL "
        "SELECT f.state, count(*), NULL, NULL "
        "FROM (SELECT state FROM {b} WHERE state IN ('complete', 'expired') LIMIT %(cap)s) f GROUP BY f.state "
        "UNION ALL "
        "SELECT e.state, NULL, NULL, (SELECT c.reltuples * u.freq FROM pg_class c, pg_stats s, "
        "unnest(s.most_common_vals::text::text[], s.most_common_freqs) u(val, freq) "
        "WHERE c.oid = %(table)s::regclass AND s.schemaname = %(schema)s AND s.tablename = 'batch' "
        "AND s.attname = 'state' AND u.val = e.state) "
        "FROM (VALUES ('complete'), ('expired')) e(state)"
    ).format(b=b)
    return statement, {"cap": cap + 1, "table": b.as_string(None), "schema": schema}


def census_of(rows: list[tuple[str, int | None, int | None, float | None]], cap: int = FINISHED_EXACT) -> BatchCensus:
    counts = dict.fromkeys(STATES, 0)
    estimates: dict[str, float] = {}
    pending = 0
    for state, counted, items, estimate in rows:
        if counted is not None:
            counts[state] = int(counted)
        if estimate is not None:
            estimates[state] = estimate
        pending += int(items or 0)
    finished = ("complete", "expired")
    if sum(counts[s] for s in finished) <= cap:
        return BatchCensus(counts, frozenset(), pending)
    # The sample stopped at its cap: each finished state is at least what the sample held of it.
    for state in finished:
        counts[state] = max(counts[state], round(estimates.get(state, 0.0)))
    return BatchCensus(counts, frozenset(finished), pending)


def batch_census(conn: psycopg.Connection, schema: str, cap: int = FINISHED_EXACT) -> BatchCensus:
    """The census of `schema`'s batches, in `conn`'s transaction (read only; never ends it)."""
    statement, params = census_statement(schema, cap)
    return census_of(conn.execute(statement, params).fetchall(), cap)


__all__ = ["BatchCensus", "FINISHED_EXACT", "batch_census", "census_of", "census_statement"]
