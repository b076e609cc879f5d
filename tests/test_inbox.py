"""The inbox (tracker.inbox, sql/R__inbox.sql) on the real Postgres: a message's effect runs once
per consumer, whatever the redeliveries; the caller's transaction is sacred; bad input is refused
with a typed error naming it; the SQL functions and their grants."""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
import uuid

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql
from support.teardown import drop_schema

from tracker import inbox, roles
from tracker import schema as schema_mod
from tracker.errors import SQLSTATES, InvalidArgument, InvalidIdentifier, InvalidValue
from tracker.inbox import AsyncInbox, Inbox, IsolationNotSupported, NoInboxPartition

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


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    value=st.one_of(
        st.text(max_size=260),
        st.binary(max_size=300),
        st.integers(),
        st.none(),
        st.lists(st.text(max_size=3), max_size=2),
    )
)
def test_a_message_id_is_checked_before_anything_is_written(pg_dsn, schema, value):
    """Any value: accepted (1 to 200 characters of text, UTF-8 bytes) and recorded, or refused
    with a typed error naming it, the caller's transaction unchanged and usable."""
    box = Inbox("c", schema=schema)
    text = value.decode("utf-8", "strict") if isinstance(value, bytes) and _utf8(value) else value
    valid = isinstance(text, str) and 1 <= len(text) <= 200 and "\x00" not in text
    with psycopg.connect(pg_dsn) as conn:
        if valid:
            assert box.claim(conn, value) is True
            assert box.claim(conn, value) is False
        else:
            with pytest.raises((InvalidArgument, InvalidValue)) as err:
                box.claim(conn, value)
            assert err.value.name == "message_id"  # names the argument, and its value as written
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE  # nothing was sent
        conn.rollback()


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_a_lone_surrogate_is_refused_naming_it(pg_dsn, schema):
    # A str that is not text (bytes decoded with surrogateescape, say): UTF-8 cannot encode it.
    box = Inbox("c", schema=schema, registry=None)
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("SELECT 1")
        with pytest.raises(InvalidValue) as err:
            box.claim(conn, "id-\udcff")
        assert err.value.name == "message_id" and repr("id-\udcff") in str(err.value)
        conn.execute("SELECT 1")  # the caller's transaction goes on
        conn.rollback()


def test_a_consumer_name_is_checked(schema):
    for bad in ["", "x" * 201, None, 3, "a\x00b", "a\ud800"]:
        with pytest.raises((InvalidArgument, InvalidValue)):
            Inbox(bad, schema=schema)  # type: ignore[arg-type]


def test_repeatable_read_is_refused_and_the_caller_goes_on(pg_dsn, schema):
    box = Inbox("c", schema=schema)
    with psycopg.connect(pg_dsn) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.execute("SELECT 1")
        with pytest.raises(IsolationNotSupported):
            box.claim(conn, "m")
        conn.execute("SELECT 1")  # still usable
        conn.rollback()
        conn.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
        assert box.claim(conn, "m")
        conn.commit()


def test_the_inbox_refusals_have_sqlstates_of_their_own(pg_dsn, schema):
    # Each refusal's SQLSTATE is documented with the inbox's error, and none is another refusal's:
    # an effect whose tracker call is refused (TooManyGroups, RT008) is not an isolation problem.
    box = Inbox("c", schema=schema, registry=None)
    with psycopg.connect(pg_dsn) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        with pytest.raises(IsolationNotSupported) as raised:
            box.claim(conn, "m")
        conn.rollback()
    state = raised.value.__cause__.sqlstate
    assert SQLSTATES[state][1] == (IsolationNotSupported,)

    def refused(c: psycopg.Connection) -> None:
        c.execute("DO $$ BEGIN RAISE EXCEPTION 'too many groups' USING ERRCODE = 'RT008'; END $$")

    with psycopg.connect(pg_dsn) as conn:
        with pytest.raises(psycopg.Error) as raised_by_effect:
            box.run_once(conn, "m2", refused)
        assert raised_by_effect.value.sqlstate == "RT008"


def test_a_claim_with_no_partition_for_now_names_it(pg_dsn, schema):
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        for (name,) in admin.execute(
            sql.SQL("SELECT name FROM {}").format(sql.Identifier(schema, "inbox_partition"))
        ).fetchall():
            admin.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(schema, name)))
        admin.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(schema, "inbox_partition")))
    with psycopg.connect(pg_dsn) as conn:
        with pytest.raises(NoInboxPartition, match="no inbox partition holds"):
            Inbox("c", schema=schema).claim(conn, "m")
        conn.execute("SELECT 1")


def _boundary_after(dsn: str, schema: str, t1: datetime.datetime) -> None:
    """Replace the inbox's partitions by two whose boundary lies just after `t1`: a transaction
    whose now() is t1 claims into "old", one begun later into "new"."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        names = [n for (n,) in admin.execute("SELECT name FROM inbox_partition").fetchall()]
        for n in names:
            admin.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(n)))
        admin.execute("DELETE FROM inbox_partition")
        boundary = t1 + datetime.timedelta(microseconds=1)
        for n, lo, hi in [("old", "-infinity", boundary), ("new", boundary, "infinity")]:
            admin.execute(sql.SQL("CREATE TABLE {} (LIKE inbox)").format(sql.Identifier(n)))
            admin.execute(sql.SQL("CREATE UNIQUE INDEX ON {} (consumer, message_id)").format(sql.Identifier(n)))
            admin.execute(
                sql.SQL("ALTER TABLE inbox ATTACH PARTITION {} FOR VALUES FROM ({}) TO ({})").format(
                    sql.Identifier(n), sql.Literal(lo), sql.Literal(hi)
                )
            )
            admin.execute("INSERT INTO inbox_partition VALUES (%s, %s, %s)", [n, lo, hi])


def test_a_concurrent_duplicate_across_a_partition_boundary_waits_and_runs_nothing(pg_dsn, schema):
    """READ COMMITTED: the first claim (into the older partition) is not committed yet when the
    second (into the newer one, whose unique index cannot see the first's row) looks: the advisory
    lock makes the second wait, then find the first's commit. Rolled back instead, the second
    records the id itself."""
    box = Inbox("c", schema=schema, registry=None)
    for first_commits in (True, False):
        mid = f"m-{first_commits}"
        with psycopg.connect(pg_dsn) as first, psycopg.connect(pg_dsn) as second:
            (t1,) = first.execute("SELECT now()").fetchone()
            _boundary_after(pg_dsn, schema, t1)
            assert box.claim(first, mid)
            got: list[bool] = []
            waiter = threading.Thread(target=lambda: got.append(box.claim(second, mid)))
            waiter.start()
            waiter.join(0.5)
            assert waiter.is_alive(), "the second claim did not wait for the first"
            first.commit() if first_commits else first.rollback()
            waiter.join(10)
            second.commit()
            assert got == [not first_commits]
        with psycopg.connect(pg_dsn) as c:
            rows = c.execute(
                sql.SQL("SELECT tableoid::regclass::text FROM {} WHERE message_id = %s").format(
                    sql.Identifier(schema, "inbox")
                ),
                [mid],
            ).fetchall()
        assert len(rows) == 1 and rows[0][0].endswith("old" if first_commits else "new")


def test_serializable_claims_across_a_partition_boundary_never_run_twice(pg_dsn, schema):
    """The case the advisory lock alone cannot cover: the first claim commits into an older
    partition than the one the second inserts into, and the second's snapshot predates that
    commit. SERIALIZABLE must refuse the second (a serialization failure), never record it again;
    READ COMMITTED sees the commit."""
    for level, expect_failure in [
        (psycopg.IsolationLevel.SERIALIZABLE, True),
        (psycopg.IsolationLevel.READ_COMMITTED, False),
    ]:
        mid = f"m-{level.name}"
        with psycopg.connect(pg_dsn) as first, psycopg.connect(pg_dsn) as second:
            first.isolation_level = second.isolation_level = level
            (t1,) = first.execute("SELECT now()").fetchone()
            _boundary_after(pg_dsn, schema, t1)
            second.execute("SELECT 1")  # its snapshot, now: before the first's commit
            box = Inbox("c", schema=schema)
            assert box.claim(first, mid)
            first.commit()
            try:
                got = box.claim(second, mid)
                second.commit()
            except psycopg.errors.SerializationFailure:
                got = None
                second.rollback()
            with psycopg.connect(pg_dsn) as c:
                (rows,) = c.execute(
                    sql.SQL("SELECT count(*) FROM {} WHERE message_id = %s").format(sql.Identifier(schema, "inbox")),
                    [mid],
                ).fetchone()
            assert rows == 1, level
            assert got is (None if expect_failure else False), level


@pytest.mark.parametrize("first_level", [psycopg.IsolationLevel.READ_COMMITTED, psycopg.IsolationLevel.SERIALIZABLE])
@pytest.mark.parametrize("first_side", ["older", "newer"])
def test_a_serializable_claim_never_runs_twice_whatever_the_other_claims_isolation(
    pg_dsn, schema, first_level, first_side
):
    """Postgres checks serializability only among SERIALIZABLE transactions: a SERIALIZABLE claim
    whose snapshot predates another claim's commit (READ COMMITTED or not), that other claim's row in
    another partition than its own insert (older or newer), must still be refused (a serialization
    failure), never recorded again, and a retry finds the id recorded."""
    mid = f"m-{first_level.name}-{first_side}"
    box = Inbox("c", schema=schema, registry=None)
    with psycopg.connect(pg_dsn) as first, psycopg.connect(pg_dsn) as second, psycopg.connect(pg_dsn) as clock:
        first.isolation_level = first_level
        second.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
        (boundary,) = clock.execute("SELECT clock_timestamp() + interval '400 ms'").fetchone()
        _boundary_after(pg_dsn, schema, boundary)
        early, late = (first, second) if first_side == "older" else (second, first)
        early.execute("SELECT now()")  # begins before the boundary: its claim goes to "old"
        while clock.execute("SELECT clock_timestamp() <= %s", [boundary]).fetchone()[0]:
            time.sleep(0.05)
        late.execute("SELECT now()")  # after it: "new"
        second.execute("SELECT 1")  # the second's snapshot, taken before the first's commit either way
        assert box.claim(first, mid)
        first.commit()
        with pytest.raises(psycopg.errors.SerializationFailure):
            box.claim(second, mid)
        second.rollback()
        assert box.claim(second, mid) is False  # the retry, a new snapshot: already recorded
        second.commit()
        (rows,) = clock.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE message_id = %s").format(sql.Identifier(schema, "inbox")), [mid]
        ).fetchone()
        assert rows == 1


@pytest.mark.parametrize("change", ["attached after the snapshot", "renamed"])
def test_a_serializable_claim_probes_the_partitions_as_the_catalog_has_them_now(pg_dsn, schema, change):
    """The partitions probed are read from the catalog as it is at the claim, not as the claim's
    snapshot had them: one the maintenance attached since (the other claim's row in it), or one an
    operator renamed, is probed too."""
    mid = f"m-{change}"
    box = Inbox("c", schema=schema, registry=None)
    with (
        psycopg.connect(pg_dsn) as first,
        psycopg.connect(pg_dsn) as second,
        psycopg.connect(pg_dsn, autocommit=True) as admin,
    ):
        second.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
        admin.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        (boundary,) = admin.execute("SELECT clock_timestamp() + interval '400 ms'").fetchone()
        _boundary_after(pg_dsn, schema, boundary)
        if change == "attached after the snapshot":
            admin.execute("DROP TABLE new")
            admin.execute("DELETE FROM inbox_partition WHERE name = 'new'")
            second.execute("SELECT 1")  # its snapshot: before "new" exists, in "old"
            while admin.execute("SELECT clock_timestamp() <= %s", [boundary]).fetchone()[0]:
                time.sleep(0.05)
            admin.execute("CREATE TABLE new (LIKE inbox)")
            admin.execute("CREATE UNIQUE INDEX ON new (consumer, message_id)")
            admin.execute(
                sql.SQL("ALTER TABLE inbox ATTACH PARTITION new FOR VALUES FROM ({}) TO ('infinity')").format(
                    sql.Literal(boundary + datetime.timedelta(microseconds=1))  # where "old" ends
                )
            )
            admin.execute(
                "INSERT INTO inbox_partition VALUES ('new', %s, 'infinity')",
                [boundary + datetime.timedelta(microseconds=1)],
            )
            first.execute("SELECT now()")  # after the boundary: its claim goes to "new"
        else:
            first.execute("SELECT now()")  # before the boundary: its claim goes to "old"
            while admin.execute("SELECT clock_timestamp() <= %s", [boundary]).fetchone()[0]:
                time.sleep(0.05)
            second.execute("SELECT 1")  # after it: "new"; its snapshot before the first's commit
        assert box.claim(first, mid)
        first.commit()
        if change == "renamed":
            admin.execute("ALTER TABLE old RENAME TO old_renamed")
        with pytest.raises(psycopg.errors.SerializationFailure):
            box.claim(second, mid)
        second.rollback()
        (rows,) = admin.execute("SELECT count(*) FROM inbox WHERE message_id = %s", [mid]).fetchone()
        assert rows == 1


def test_the_sql_functions_for_other_languages(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        assert conn.execute(
            "SELECT inbox_claim('a', 'm'), inbox_claim('a', 'm'), inbox_claim('b', 'm')"
        ).fetchone() == (
            True,
            False,
            True,
        )
        rows = conn.execute("SELECT consumer_name, partition_name FROM inbox_show('m')").fetchall()
        assert [r[0] for r in rows] == ["a", "b"] and all(r[1].startswith("inbox_p") for r in rows)
        assert [r[0] for r in conn.execute("SELECT * FROM inbox_show('m', 'b')").fetchall()] == ["b"]
        assert conn.execute("SELECT count(*) FROM inbox_show('nope')").fetchone() == (0,)
        conn.commit()
        for bad, shown in [("''", ""), ("repeat('x', 201)", "x" * 60), ("NULL", "null")]:
            with pytest.raises(psycopg.DatabaseError) as err:
                conn.execute(f"SELECT inbox_claim('a', {bad})")
            assert err.value.sqlstate == "RT007" and err.value.diag.message_detail == shown
            conn.rollback()
        parts = conn.execute("SELECT name, attached, holds_ids FROM inbox_partitions()").fetchall()
        assert len(parts) >= 4 and all(a for _, a, _ in parts) and any(h for _, _, h in parts)


def test_a_consumer_role_claims_through_the_function_and_touches_no_table(pg_dsn, schema):
    from test_roles import _drop_role, login_as

    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        roles.create(admin, schema)
    try:
        with login_as(pg_dsn, schema, "consumer") as conn:
            conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
            assert conn.execute("SELECT inbox_claim('a', %s)", [uuid.uuid4().hex]).fetchone() == (True,)
            conn.commit()
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SELECT count(*) FROM inbox")
            conn.rollback()
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SELECT inbox_drop_expired('1 day')")
            conn.rollback()
        with login_as(pg_dsn, schema, "operator") as conn:
            conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
            assert conn.execute("SELECT count(*) FROM inbox_partitions()").fetchone()[0] >= 4
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            for r in roles.ROLES:
                _drop_role(admin, roles.role_name(schema, r))


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


@pytest.mark.parametrize("consumer", [["billing"], {"a": 1}, 7, None, ""])
def test_the_module_functions_name_a_bad_consumer_of_any_type(pg_dsn, schema, consumer):
    with psycopg.connect(pg_dsn) as conn:
        for call in (
            lambda: inbox.claim(conn, "m", consumer=consumer, schema=schema),
            lambda: inbox.run_once(conn, "m", lambda c: None, consumer=consumer, schema=schema),
        ):
            with pytest.raises((InvalidArgument, InvalidValue)) as info:
                call()
            assert str(info.value).startswith("consumer")
        with pytest.raises(InvalidIdentifier, match="schema"):
            inbox.claim(conn, "m", consumer="c", schema=["reaper"])
        conn.execute("SELECT 1")  # the caller's transaction goes on
