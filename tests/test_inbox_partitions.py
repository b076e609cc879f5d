"""Inbox claims across the inbox's time partitions: a claim with no partition for now names it;
a duplicate claimed across a partition boundary (or a partition attached or renamed meanwhile)
waits for the first and runs nothing, under read committed and serializable alike."""

from __future__ import annotations

import datetime
import threading
import time

import psycopg
import pytest
from psycopg import sql

from tracker.inbox import Inbox, NoInboxPartition


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
