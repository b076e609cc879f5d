"""The SQL query the inbox how-to gives for a row's message id names every row as the reaper does:
the long and the short form, the ends of time and a row without created_at."""

from __future__ import annotations

from pathlib import Path

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.examples import examples
from support.harness import marked

from tracker import message_ids

ROOT = Path(__file__).resolve().parent.parent


def howto_query(schema: str) -> str:
    """The how-to's query for `schema` instead of `reaper`, without its LIMIT."""
    [query] = [
        e.code
        for e in examples(ROOT / "docs" / "howto" / "inbox.md")
        if e.language == "sql" and "suffix_from" in e.code
    ]
    assert "reaper." in query and "LIMIT 5" in query
    return query.replace("reaper.", f'"{schema}".').replace("LIMIT 5", "")


def published_ids(pg_dsn: str, schema: str) -> dict[int, str]:
    """Row id -> the message id the harvester gives the row."""
    ns, rows = marked(pg_dsn, schema, 1000)
    return {r[0]: ns.message_id(r[0], r[7] + message_ids.PG_EPOCH_US) for r in rows}


EDGES = ["-infinity", "infinity", "294276-12-31 23:59:59.999999+00", "4713-11-24 00:00:00+00 BC", None]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    suffix_from=st.sampled_from(["-infinity", "2000-01-01 00:00:00+00", "2026-11-26 12:00:00.5+00", "infinity"]),
    times=st.lists(
        st.one_of(
            st.sampled_from(EDGES),
            st.integers(min_value=-(10**15), max_value=10**16).map(lambda us: f"epoch {us}"),
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_the_howto_query_gives_each_row_the_id_it_is_published_with(pg_dsn, schema, suffix_from, times):
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'DELETE FROM "{schema}".outbox')
        c.execute(f'ALTER TABLE "{schema}".outbox ALTER COLUMN created_at DROP NOT NULL')
        c.execute(f'UPDATE "{schema}".outbox_namespace SET suffix_from = %s::timestamptz', [suffix_from])
        for at in times:
            if at is not None and at.startswith("epoch "):
                c.execute(
                    f'INSERT INTO "{schema}".outbox (topic, value, created_at) '
                    "VALUES ('t', 'v', to_timestamp(0) + %s * interval '1 microsecond')",
                    [int(at.removeprefix("epoch "))],
                )
            else:
                c.execute(
                    f"INSERT INTO \"{schema}\".outbox (topic, value, created_at) VALUES ('t', 'v', %s::timestamptz)",
                    [at],
                )
        from_sql = dict(c.execute(howto_query(schema)).fetchall())
    assert from_sql == published_ids(pg_dsn, schema)
