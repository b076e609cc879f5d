"""An application's own outbox table whose columns the harvester cannot publish (a `text` key, a
`jsonb` value, a column missing) is refused before anything is marked, with an error naming each
column, and harvested as soon as it is altered; before, the producing thread died on the first row
with a TypeError naming neither table nor column, and `reaper run` exited."""

from __future__ import annotations

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.harness import Receiver, make_config, wait_until
from support.json_log import events, json_log

from harvester.publishing.table_shape import EXPECTED, OutboxShapeRefused, check_shape
from harvester.units import Harvester

TYPES = [
    "bigint",
    "integer",
    "smallint",
    "numeric",
    "text",
    "varchar(20)",
    "char(5)",
    "bytea",
    "jsonb",
    "uuid",
    "timestamptz",
    "timestamp",
    "date",
    "text[]",
    "varchar[]",
    "bytea[]",
    "jsonb[]",
]
# the base type as pg's format_type names it, for each of TYPES
BASE = {"varchar(20)": "character varying", "char(5)": "character", "timestamptz": "timestamp with time zone"}
BASE |= {"timestamp": "timestamp without time zone", "varchar[]": "character varying[]"}


def _make(conn: psycopg.Connection, schema: str, table: str, columns: dict[str, str], domain: bool) -> None:
    conn.execute(f'DROP TABLE IF EXISTS "{schema}"."{table}"')
    parts = []
    for i, (name, kind) in enumerate(columns.items()):
        if domain and not kind.endswith("[]"):  # a domain counts as its base type
            conn.execute(f'CREATE DOMAIN "{schema}".d_{i} AS {kind}')
            kind = f'"{schema}".d_{i}'
        parts.append(f'"{name}" {kind}')
    conn.execute(f'CREATE TABLE "{schema}"."{table}" ({", ".join(parts)})')


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    changed=st.dictionaries(st.sampled_from(sorted(EXPECTED)), st.sampled_from(TYPES + ["(missing)"]), max_size=3),
    domain=st.booleans(),
)
def test_the_shape_check_accepts_exactly_the_types_it_can_publish(pg_dsn, bare_schema, changed, domain):
    columns = {
        "id": "bigint",
        "created_at": "timestamptz",
        "topic": "text",
        "key": "bytea",
        "value": "bytea",
        "header_keys": "text[]",
        "header_values": "bytea[]",
        "kafka_partition": "integer",
        "leader_id": "uuid",
    }
    for name, kind in changed.items():
        if kind == "(missing)":
            del columns[name]
        else:
            columns[name] = kind
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for (d,) in conn.execute(
            "SELECT typname FROM pg_type WHERE typnamespace = %s::regnamespace AND typtype = 'd'", [bare_schema]
        ).fetchall():
            conn.execute(f'DROP DOMAIN "{bare_schema}"."{d}" CASCADE')
        _make(conn, bare_schema, "app_outbox", columns, domain)
        wrong = sorted(
            name
            for name, (accepted, _) in EXPECTED.items()
            if name not in columns or BASE.get(columns[name], columns[name]) not in accepted
        )
        if not wrong:
            check_shape(conn, f'"{bare_schema}"."app_outbox"')
            return
        with pytest.raises(OutboxShapeRefused) as refused:
            check_shape(conn, f'"{bare_schema}"."app_outbox"')
        named = sorted(name for name in EXPECTED if f"; {name} is " in f"; {str(refused.value).split(': ', 1)[1]}")
        assert named == wrong, str(refused.value)


def test_a_table_that_does_not_exist_is_left_to_the_mark_to_report(pg_dsn, bare_schema):
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        check_shape(conn, f'"{bare_schema}"."no_such_table"')


def test_a_unit_on_a_table_it_cannot_publish_says_which_columns_and_publishes_once_altered(
    pg_dsn, kafka_bootstrap, schema, bare_schema, topics
):
    topic = topics("data", partitions=1)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE TABLE "{bare_schema}".orders (LIKE "{schema}".outbox INCLUDING ALL)')
        conn.execute(f"ALTER TABLE \"{bare_schema}\".orders ALTER COLUMN key TYPE text USING encode(key, 'escape')")
        conn.execute(
            f"INSERT INTO \"{bare_schema}\".orders (topic, key, value) SELECT %s, 'k' || i, ('v' || i)::bytea"
            " FROM generate_series(1, 20) i",
            [topic],
        )
    outboxes = [{"name": "orders", "schema": bare_schema, "table": "orders"}]
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, harvester={"outboxes": outboxes})
    receiver = Receiver(kafka_bootstrap, topic, 1)
    with json_log() as out:
        h = Harvester(cfg).start()
        try:
            refused = "not marking: the outbox table's columns cannot be published"
            assert wait_until(lambda: any(e["event"] == refused for e in events(out)), 30)
            error = next(e for e in events(out) if e["event"] == refused)["error"]
            assert "key is text (want bytea)" in error and f'"{bare_schema}"."orders"' in error, error
            assert h.error is None and receiver.values() == []
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute(f'ALTER TABLE "{bare_schema}".orders ALTER COLUMN key TYPE bytea USING key::bytea')
            expected = {b"v%d" % i for i in range(1, 21)}
            assert wait_until(lambda: expected <= set(receiver.values()), 30), "not harvested once altered"
            assert h.error is None
            logged = [e for e in events(out) if e["event"] == refused]
            assert len(logged) == 1, "the same refusal is logged once, not at every retry"
        finally:
            h.stop(5)
            receiver.close()
