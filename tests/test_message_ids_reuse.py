"""Message ids never come again: a row id used again after the outbox's sequence went back
(TRUNCATE ... RESTART IDENTITY, setval) is a new message id, so an inbox consumer processes the new
row instead of skipping it as a duplicate; and an upgrade keeps the id of a row created before it."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import psycopg
import pytest
from support.harness import Receiver, make_config, outbox_count, wait_until
from support.history import sql_at
from support.teardown import drop_schema

from harvester.units import Harvester
from tracker import message_ids
from tracker import schema as schema_mod
from tracker.message_ids import MESSAGE_ID_HEADER

REPO = Path(__file__).resolve().parents[1]
BEFORE_CREATED = "f76b248"  # the last commit whose message ids are `<namespace>:<row id>` for every row


def _insert(pg_dsn: str, schema: str, topic: str, tag: str, n: int = 30) -> list[int]:
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        return [
            i
            for (i,) in c.execute(
                f'INSERT INTO "{schema}".outbox (topic, key, value) '
                "SELECT %s, ('k' || (i %% 4))::bytea, (%s || i)::bytea FROM generate_series(1, %s) i RETURNING id",
                [topic, tag, n],
            )
        ]


def _publish_all(pg_dsn: str, schema: str, bootstrap: str) -> None:
    h = Harvester(make_config(pg_dsn, schema, bootstrap)).start()
    try:
        assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0, 60), "rows left in the outbox"
    finally:
        h.stop(5)


def _ids(receiver: Receiver, tag: bytes) -> dict[bytes, list[bytes]]:
    """value -> the message ids of its records, for the values starting with `tag`."""
    out: dict[bytes, list[bytes]] = {}
    with receiver._lock:
        records = list(receiver.records)
    for _, value, headers in records:
        if value.startswith(tag):
            out.setdefault(value, []).extend(v for k, v in headers if k == MESSAGE_ID_HEADER)
    return out


@pytest.mark.parametrize("how", ["truncate", "setval"])
def test_a_row_id_used_again_after_the_sequence_went_back_is_a_new_message_id(
    pg_dsn, kafka_bootstrap, schema, topics, how
):
    topic = topics("data", partitions=1)
    receiver = Receiver(kafka_bootstrap, topic, 1)
    try:
        before = _insert(pg_dsn, schema, topic, "before")
        _publish_all(pg_dsn, schema, kafka_bootstrap)
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            if how == "truncate":
                c.execute(f'TRUNCATE "{schema}".outbox RESTART IDENTITY')
            else:
                c.execute(
                    "SELECT setval(pg_get_serial_sequence(%s, 'id'), %s, false)", [f'"{schema}".outbox', min(before)]
                )
        after = _insert(pg_dsn, schema, topic, "after")
        assert sorted(after) == sorted(before)  # the same row ids again
        _publish_all(pg_dsn, schema, kafka_bootstrap)
        assert wait_until(lambda: len(_ids(receiver, b"before")) == len(_ids(receiver, b"after")) == 30, 30)
    finally:
        receiver.close()
    old = {i for ids in _ids(receiver, b"before").values() for i in ids}
    new = {i for ids in _ids(receiver, b"after").values() for i in ids}
    assert len(old) == len(new) == 30
    assert not old & new, "a new row was published with the message id of an earlier one"
    # An inbox consumer that saw the earlier rows takes every new one as new.
    with psycopg.connect(pg_dsn) as c:
        c.execute(f'SET search_path TO "{schema}"')
        claims = [c.execute("SELECT inbox_claim('c', %s)", [i.decode()]).fetchone()[0] for i in sorted(old | new)]
        c.rollback()
    assert all(claims)


def test_an_upgrade_keeps_the_id_of_rows_created_before_it_and_names_later_rows_by_created_at(
    pg_dsn, tmp_path, kafka_bootstrap, topics
):
    """Rows created before the migration, published by the previous version whose leader died
    before purging them, are published again with the id they had; rows created after it get the
    new form, and so does every row of a table registered after it."""
    old_sql = sql_at(BEFORE_CREATED, tmp_path)
    name = f"t_{uuid.uuid4().hex[:12]}"
    schema_mod.migrate(pg_dsn, name, old_sql)
    topic = topics("data", partitions=1)
    try:
        old_rows = _insert(pg_dsn, name, topic, "old")
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(f'SET search_path TO "{name}"')
            (ns,) = c.execute("SELECT namespace FROM outbox_namespace").fetchone()
            # Published by a leader of the previous version that died before its purge: still marked.
            c.execute("UPDATE outbox SET leader_id = gen_random_uuid()")
            old_ids = dict(c.execute("SELECT value, id FROM outbox").fetchall())
            assert "0022_message_id_created.sql" in schema_mod.migrate(pg_dsn, name)
            before = c.execute("SELECT pg_relation_filenode('outbox')").fetchone()
        new_rows = _insert(pg_dsn, name, topic, "new")
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            new_at = dict(c.execute(f'SELECT id, created_at FROM "{name}".outbox WHERE id = ANY(%s)', [new_rows]))
            assert c.execute(f"SELECT pg_relation_filenode('\"{name}\".outbox')").fetchone() == before
        namespace = message_ids.namespace(psycopg.connect(pg_dsn, autocommit=True), name)
        assert namespace.uuid == ns and namespace.suffix_from != message_ids.ALL_ROWS
        receiver = Receiver(kafka_bootstrap, topic, 1)
        try:
            _publish_all(pg_dsn, name, kafka_bootstrap)
            assert wait_until(lambda: len(_ids(receiver, b"old")) == len(_ids(receiver, b"new")) == 30, 30)
        finally:
            receiver.close()
        for value, ids in _ids(receiver, b"old").items():
            assert ids == [f"{ns}:{old_ids[value]}".encode()], value  # as the previous version published it
        new_ids = {i for ids in _ids(receiver, b"new").values() for i in ids}
        assert new_ids == {f"{ns}:{i}:{message_ids.micros(new_at[i])}".encode() for i in new_rows}
        assert len(old_rows) == 30
    finally:
        drop_schema(pg_dsn, name)


def test_a_namespace_table_the_previous_version_created_itself_gets_the_cutover(pg_dsn, schema):
    """In a schema `reaper migrate` never ran in, the previous version's reaper created the namespace
    table (0017 alone) and registered its table: this version adds the column, as 0022 does."""
    from harvester.publishing.outbox_sql import OutboxStore, make_pool

    bare = f"bare_{uuid.uuid4().hex[:8]}"
    text = (REPO / "sql" / "0017_message_id.sql").read_text()
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'CREATE SCHEMA "{bare}"')
        c.execute(f'CREATE TABLE "{bare}".orders (LIKE "{schema}".outbox INCLUDING ALL)')
        c.execute(f'SET search_path TO "{bare}"')
        c.execute(text)
        (ns,) = c.execute("INSERT INTO outbox_namespace (outbox) VALUES ('orders') RETURNING namespace").fetchone()
    pool = make_pool(pg_dsn, 1)
    try:
        got = OutboxStore(pool, bare, "orders").namespace()
        assert got.uuid == ns and got.suffix_from != message_ids.ALL_ROWS  # its earlier rows keep their ids
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(f'CREATE TABLE "{bare}".more (LIKE "{schema}".outbox INCLUDING ALL)')
        assert OutboxStore(pool, bare, "more").namespace().suffix_from == message_ids.ALL_ROWS
    finally:
        pool.close()
        drop_schema(pg_dsn, bare, if_exists=False)
