"""Schema, table and outbox names from configuration: refused at load, naming the key and the value
as written, when they are not what the rule says (a trailing newline from a ConfigMap made from a
file), when a name derived from them would not be an identifier, or when two outbox entries name
one table; and refused the same way by the tracker where the library takes them."""

from __future__ import annotations

import os
import uuid

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from psycopg import sql
from support.reaper import run_cli
from support.teardown import drop_schema

from harvester import config
from harvester.exit_codes import ExitCode
from tracker import message_ids, roles
from tracker.config import TrackerConfig
from tracker.errors import InvalidIdentifier
from tracker.roles import ROLES
from tracker.schema import check_identifier, migrate

# The documented limits: Postgres keeps 63 bytes of a name, and `<schema>_consumer`, `<table>_dead` must fit.
MAX_SCHEMA_BYTES, MAX_OUTBOX_TABLE_BYTES = 54, 58


def refusal(overrides: dict) -> config.ConfigError:
    with pytest.raises(config.ConfigError) as err:
        config.load(None, environ={}, overrides=overrides)
    return err.value


# ------------------------------------------------------------------ a trailing newline


@given(name=st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,40}", fullmatch=True), tail=st.sampled_from(["\n", "\r\n", " "]))
def test_an_identifier_with_a_line_end_is_refused(name: str, tail: str) -> None:
    assert check_identifier(name, "table") == name
    with pytest.raises(InvalidIdentifier):
        check_identifier(name + tail, "table")


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"database": {"schema": "reaper\n"}}, "database.schema"),
        ({"database": {"outbox_table": "outbox\n"}}, "database.outbox_table"),
        ({"harvester": {"outboxes": [{"name": "orders\n"}]}}, "harvester.outboxes[0].name"),
        ({"harvester": {"outboxes": [{"name": "orders", "table": "orders\n"}]}}, "harvester.outboxes[0].table"),
        ({"harvester": {"outboxes": [{"name": "orders", "schema": "billing\n"}]}}, "harvester.outboxes[0].schema"),
    ],
)
def test_the_configuration_refuses_a_trailing_newline(overrides: dict, key: str) -> None:
    err = refusal(overrides)
    assert err.key == key, str(err)
    assert "\\n'" in str(err), str(err)  # the value as written, its newline shown


# ------------------------------------------------------------------ room for the names derived from them


def named(prefix: str, size: int) -> str:
    return (prefix + "x" * size)[:size]


@given(size=st.integers(min_value=1, max_value=70))
def test_a_schema_leaves_room_for_its_roles_and_an_outbox_table_for_its_dead_table(size: int) -> None:
    for what, limit, derived in (
        ("schema", MAX_SCHEMA_BYTES, [f"_{r}" for r in ROLES]),
        ("outbox table", MAX_OUTBOX_TABLE_BYTES, ["_dead"]),
    ):
        name = named("n", size)
        if size <= limit:
            assert check_identifier(name, what) == name
            for suffix in derived:  # what is made of it is an identifier too
                check_identifier(name + suffix, "table")
        else:
            with pytest.raises(InvalidIdentifier, match=f"at most {limit} to leave room"):
                check_identifier(name, what)


@pytest.mark.parametrize(
    ("overrides", "key", "value"),
    [
        ({"database": {"schema": named("s", 55)}}, "database.schema", named("s", 55)),
        ({"database": {"outbox_table": named("t", 59)}}, "database.outbox_table", named("t", 59)),
        (
            {"harvester": {"outboxes": [{"name": "a"}, {"name": "b", "schema": named("s", 63)}]}},
            "harvester.outboxes[1].schema",
            named("s", 63),
        ),
        (
            {"harvester": {"outboxes": [{"name": "a", "table": named("t", 63)}]}},
            "harvester.outboxes[0].table",
            named("t", 63),
        ),
        # the `database` section's schema acks and sweeps whatever the outboxes name
        (
            {"database": {"schema": named("s", 60)}, "harvester": {"outboxes": [{"name": "a", "schema": "other"}]}},
            "database.schema",
            named("s", 60),
        ),
    ],
    ids=["schema", "outbox_table", "entry schema", "entry table", "schema under outboxes"],
)
def test_the_configuration_refuses_a_name_too_long_for_what_is_derived_from_it(overrides, key, value) -> None:
    err = refusal(overrides)
    assert err.key == key, str(err)
    assert repr(value) in str(err), str(err)


def test_the_longest_names_the_configuration_takes_work(pg_dsn) -> None:
    schema, table = named("mu_" + uuid.uuid4().hex[:8], MAX_SCHEMA_BYTES), named("ob_", MAX_OUTBOX_TABLE_BYTES)
    cfg = config.load(None, environ={}, overrides={"database": {"schema": schema, "outbox_table": table}})
    try:
        migrate(pg_dsn, cfg.database.schema)
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
            c.execute(sql.SQL("CREATE TABLE {} (LIKE outbox INCLUDING ALL)").format(sql.Identifier(table)))
            c.execute(
                sql.SQL("CREATE TABLE {} (LIKE outbox_dead INCLUDING ALL)").format(sql.Identifier(table + "_dead"))
            )
            script = roles.script(c, schema)  # every role's name is whole
            assert all(sql.Identifier(f"{schema}_{r}").as_string(c) in script for r in ROLES)
        env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
        env |= {"REAPER_DATABASE__DSN": pg_dsn, "REAPER_DATABASE__SCHEMA": schema}
        r = run_cli(["dead", "list"], env | {"REAPER_DATABASE__OUTBOX_TABLE": table})
        assert r.returncode == ExitCode.OK, r.stderr
        r = run_cli(["dead", "list"], env | {"REAPER_DATABASE__OUTBOX_TABLE": table + "x"})
        assert r.returncode == ExitCode.USAGE, r.stderr
        assert "database.outbox_table" in r.stderr and repr(table + "x") in r.stderr, r.stderr
    finally:
        drop_schema(pg_dsn, schema)


def test_the_tracker_refuses_a_name_too_long_for_what_is_derived_from_it(conn, schema) -> None:
    long_schema, long_table = named("s", MAX_SCHEMA_BYTES + 1), named("t", MAX_OUTBOX_TABLE_BYTES + 1)
    for call in (
        lambda: TrackerConfig(schema=long_schema),
        lambda: TrackerConfig(outbox_table=long_table),
        lambda: migrate("host=unused", long_schema),  # refused before it connects
        lambda: roles.grants(conn, long_schema),
        lambda: message_ids.namespace(conn, schema, long_table),
    ):
        with pytest.raises(InvalidIdentifier, match="to leave room for"):
            call()
    assert conn.info.transaction_status in (psycopg.pq.TransactionStatus.IDLE, psycopg.pq.TransactionStatus.INTRANS)


# ------------------------------------------------------------------ one table, one entry


@pytest.mark.parametrize(
    ("entries", "second"),
    [
        ([{"name": "a"}, {"name": "b", "schema": "reaper", "table": "outbox"}], 1),
        (
            [{"name": "a", "table": "orders"}, {"name": "b", "lanes": 2}, {"name": "c", "table": "orders", "lanes": 3}],
            2,
        ),
        # one database written two ways, with other users and options
        (
            [
                {"name": "a", "dsn": "postgresql://app:s3cret@db1:5432/shop", "schema": "s"},
                {"name": "b", "dsn": "host=db1 port=5432 dbname=shop user=other connect_timeout=5", "schema": "s"},
            ],
            1,
        ),
    ],
    ids=["defaults written out", "among others", "one database, two DSNs"],
)
def test_a_table_listed_twice_is_refused_naming_the_second_entry(entries: list[dict], second: int) -> None:
    err = refusal({"harvester": {"outboxes": entries}})
    assert err.key == f"harvester.outboxes[{second}]", str(err)
    assert "harvester.outboxes[0]" in err.problem and "s3cret" not in str(err), str(err)


def test_the_same_table_name_elsewhere_is_another_table() -> None:
    entries = [
        {"name": "a", "table": "orders"},
        {"name": "b", "table": "orders", "schema": "billing"},
        {"name": "c", "table": "orders", "dsn": "postgresql://reaper@db2/shop"},
        {"name": "d", "table": "orders", "dsn": "postgresql://reaper@db2/shop", "schema": "Billing"},
    ]
    cfg = config.load(None, environ={}, overrides={"harvester": {"outboxes": entries}})
    assert [u.name for u in config.units(cfg)] == ["a", "b", "c", "d"]
