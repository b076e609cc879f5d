"""The message id Postgres builds in the harvester's mark is Namespace.message_id's, and the SQL
query the inbox how-to gives for a row's message id names every row as the reaper does: the long
and the short form, the ends of time and a row without created_at."""

from __future__ import annotations

import uuid
from pathlib import Path

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.examples import examples
from support.harness import marked

from harvester.publishing.outbox_sql import FOREVER, OutboxStore, make_pool
from tracker import message_ids
from tracker.message_ids import INT8_MAX, INT8_MIN, PG_EPOCH_US, Micros2000, Namespace

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
    _ns, rows = marked(pg_dsn, schema, 1000)
    return {r[0]: r[7] for r in rows}


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


# created_at as Postgres stores it (µs since 2000): its first and last finite values, ±infinity
FIRST_US2000, LAST_US2000 = message_ids.FIRST_US2000, message_ids.END_US2000 - 1
US2000 = st.one_of(
    st.sampled_from([INT8_MIN, INT8_MAX, FIRST_US2000, LAST_US2000, -PG_EPOCH_US, -PG_EPOCH_US - 1, 0, -1]),
    st.integers(min_value=FIRST_US2000, max_value=LAST_US2000),
    st.integers(min_value=-(10**15), max_value=10**16),  # around now
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.dictionaries(
        st.integers(min_value=INT8_MIN, max_value=INT8_MAX),  # row ids, any bigint
        st.one_of(st.none(), US2000),  # created_at (None: NULL)
        min_size=1,
        max_size=8,
    ),
    cut=st.one_of(
        st.sampled_from(["all", "row", "row+1", FIRST_US2000 - 1, message_ids.END_US2000]),
        US2000,
        st.integers(min_value=INT8_MIN, max_value=INT8_MAX),
    ),
    namespace=st.uuids(),
)
def test_the_id_postgres_builds_in_the_mark_is_namespace_message_id(pg_dsn, schema, rows, cut, namespace):
    """Any row id, any created_at Postgres can hold (its ends, ±infinity, NULL) and any cutover
    (before every row, exactly at a row's created_at, just after it, anywhere): the id the mark
    returns is Namespace.message_id's for the row's created_at as Python reads it."""
    some = next((us for us in rows.values() if us is not None), INT8_MIN)
    suffix_from = {"all": message_ids.ALL_ROWS, "row": some + PG_EPOCH_US, "row+1": some + 1 + PG_EPOCH_US}.get(
        cut if isinstance(cut, str) else "", (cut if isinstance(cut, int) else 0) + PG_EPOCH_US
    )
    ns = Namespace(namespace, suffix_from)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'DELETE FROM "{schema}".outbox')
        c.execute(f'ALTER TABLE "{schema}".outbox ALTER COLUMN created_at DROP NOT NULL')
        with c.cursor(binary=True) as cur:
            message_ids.bind_micros2000(cur.adapters)
            message_ids.load_timestamps_as_micros(cur.adapters)
            cur.executemany(
                f"INSERT INTO \"{schema}\".outbox (id, topic, value, created_at) VALUES (%s, 't', 'v', %s)",
                [(i, None if us is None else Micros2000(us)) for i, us in rows.items()],
            )
            stored = dict(cur.execute(f'SELECT id, created_at FROM "{schema}".outbox').fetchall())
    assert stored == rows  # exactly the values generated (bound as Postgres's own int8)
    pool = make_pool(pg_dsn, 1)
    try:
        marked_rows = OutboxStore(pool, schema).mark(uuid.uuid4(), len(rows), until=FOREVER, ids=ns)
    finally:
        pool.close()
    expected = {i: ns.message_id(i, (INT8_MIN if us is None else us) + PG_EPOCH_US) for i, us in rows.items()}
    assert {r[0]: r[7] for r in marked_rows} == expected


def test_an_application_timestamp_column_gives_the_same_id_in_every_session_time_zone(pg_dsn, schema):
    """An application's own table may keep created_at as `timestamp` (no time zone): Postgres casts
    it in the session's TimeZone, which a role, a database or a pooled connection may set. The
    mark reads time in UTC, so a row republished under another setting keeps its id."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'DELETE FROM "{schema}".outbox')
        c.execute(
            f"ALTER TABLE \"{schema}\".outbox ALTER COLUMN created_at TYPE timestamp USING created_at AT TIME ZONE 'UTC'"
        )
        c.execute(
            f'INSERT INTO "{schema}".outbox (topic, key, value, created_at) VALUES (%s, %s, %s, %s)',
            ["t", b"k", b"v", "2026-11-27 12:00:00.25"],
        )
    seen = set()
    for zone in ("Pacific/Chatham", "UTC", "America/St_Johns"):
        pool = make_pool(f"{pg_dsn}?options=-c%20TimeZone%3D{zone.replace('/', '%2F')}", 1)
        try:
            store = OutboxStore(pool, schema)
            ns = store.namespace()
            [row] = store.mark(uuid.uuid4(), 10, until=FOREVER)  # a fresh leader id: the row again
        finally:
            pool.close()
        seen.add(row[-1])
    at_utc = 1_795_780_800_250_000  # 2026-11-27 12:00:00.25 UTC, µs since the Unix epoch
    assert seen == {ns.message_id(row[0], at_utc)}, seen
