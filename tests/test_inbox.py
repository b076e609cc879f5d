"""The inbox (tracker.inbox, sql/R__inbox.sql) on the real Postgres: a message's effect runs once
per consumer, whatever the redeliveries, and the caller's transaction is sacred (a rollback leaves
the message unprocessed, an effect that raises undoes its claim); the inboxes of two schemas never
wait for each other. Bad input: test_inbox_refusals.py; claims across partition boundaries:
test_inbox_partitions.py; the SQL functions and roles: test_inbox_sql.py."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest
from psycopg import sql
from support.teardown import drop_schema

from tracker import inbox
from tracker import schema as schema_mod
from tracker.inbox import AsyncInbox, Inbox

EFFECTS = "CREATE TABLE effects (consumer text NOT NULL, message_id text NOT NULL, tag text)"


@pytest.fixture
def effects(pg_dsn, schema) -> str:
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        c.execute(EFFECTS)
    return schema


def _effect(schema: str, consumer: str, message_id: str, tag: str = "e"):
    def run(conn: psycopg.Connection) -> str:
        conn.execute(
            sql.SQL("INSERT INTO {} VALUES (%s, %s, %s)").format(sql.Identifier(schema, "effects")),
            [consumer, message_id, tag],
        )
        return tag

    return run


def _count(dsn: str, schema: str, table: str = "effects") -> int:
    with psycopg.connect(dsn) as c:
        return c.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, table))).fetchone()[0]


def test_an_effect_runs_once_per_consumer_and_a_duplicate_says_so(pg_dsn, effects):
    s = effects
    billing, shipping = Inbox("billing", schema=s), Inbox("shipping", schema=s)
    with psycopg.connect(pg_dsn) as conn:
        first = billing.run_once(conn, "order-1", _effect(s, "billing", "order-1"))
        conn.commit()
        again = billing.run_once(conn, "order-1", _effect(s, "billing", "order-1"))
        other = shipping.run_once(conn, "order-1", _effect(s, "shipping", "order-1"))
        conn.commit()
    assert (first.first_time, first.value) == (True, "e")
    assert (again.first_time, again.value) == (False, None)
    assert other.first_time
    assert _count(pg_dsn, s) == 2


def test_a_rolled_back_transaction_leaves_the_message_unprocessed(pg_dsn, effects):
    s = effects
    box = Inbox("c", schema=s)
    with psycopg.connect(pg_dsn) as conn:
        assert box.claim(conn, "m")
        conn.rollback()  # a crash between the effect and the commit
        assert box.claim(conn, "m")
        conn.commit()
        assert not box.claim(conn, "m")
        conn.commit()


def test_an_effect_that_raises_undoes_the_claim_and_leaves_the_caller_usable(pg_dsn, effects):
    s = effects
    box = Inbox("c", schema=s)

    def boom(conn: psycopg.Connection) -> None:
        _effect(s, "c", "m")(conn)
        raise RuntimeError("effect failed")

    with psycopg.connect(pg_dsn) as conn:
        _effect(s, "caller", "own")(conn)
        with pytest.raises(RuntimeError, match="effect failed"):
            box.run_once(conn, "m", boom)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        conn.commit()  # the caller's own row stands, nothing of the call
        assert box.run_once(conn, "m", _effect(s, "c", "m")).first_time
        conn.commit()
    with psycopg.connect(pg_dsn) as c:
        rows = c.execute(sql.SQL("SELECT consumer FROM {} ORDER BY 1").format(sql.Identifier(s, "effects"))).fetchall()
    assert rows == [("c",), ("caller",)]


def test_the_asyncio_face_with_a_coroutine_effect(pg_dsn, effects):
    s = effects

    async def main() -> tuple[bool, bool]:
        box = AsyncInbox("c", schema=s)
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:

            async def effect(c: psycopg.AsyncConnection) -> int:
                await c.execute(sql.SQL("INSERT INTO {} VALUES ('c', 'm', 'a')").format(sql.Identifier(s, "effects")))
                return 7

            one = await box.run_once(conn, "m", effect)
            two = await inbox.aio.run_once(conn, "m", effect, consumer="c", schema=s)
            await conn.commit()
            return one.first_time and one.value == 7, two.first_time

    assert asyncio.run(main()) == (True, False)
    assert _count(pg_dsn, s) == 1


def test_inboxes_of_two_schemas_never_wait_for_each_other(pg_dsn, schema):
    # The claim's advisory lock and the maintenance's are per schema: a claim held open in one
    # schema holds up no claim of the same id in another, nor does one schema's maintenance make
    # another's skip its partitions.
    other = f"t_{uuid.uuid4().hex[:12]}"
    schema_mod.migrate(pg_dsn, other)
    try:
        with psycopg.connect(pg_dsn) as first, psycopg.connect(pg_dsn) as second:
            assert Inbox("c", schema=schema, registry=None).claim(first, "same-id")
            second.execute("SET lock_timeout = '2s'")
            assert Inbox("c", schema=other, registry=None).claim(second, "same-id")
            second.rollback()
            first.rollback()
            first.execute(
                sql.SQL("SELECT {}('1 day', '6 days')").format(sql.Identifier(schema, "inbox_add_partitions"))
            )
            made = second.execute(
                sql.SQL("SELECT * FROM {}('1 day', '6 days')").format(sql.Identifier(other, "inbox_add_partitions"))
            ).fetchall()
            assert made, "the other schema's maintenance skipped its partitions"
            first.rollback()
            second.rollback()
    finally:
        drop_schema(pg_dsn, other)
