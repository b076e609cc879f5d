"""The inbox's retention on the real Postgres: expired partitions are dropped whole and upcoming
ones made while consumers claim ids (one of them holding its transaction open 1.5 s at a time),
and no claim waits on a lock longer than a stated bound, 1 s. A DROP with no lock timeout queues
behind that long transaction and holds every claim behind it for as long (measured: 1.5 s, and this
test fails); the concurrent detach holds none, the SQL function's DROP at most its 100 ms lock
timeout. Lock waits are read from pg_locks.waitstart by a sampler, for the consumers' backends only."""

from __future__ import annotations

import datetime
import threading
import time
import uuid

import psycopg
import pytest
from psycopg import sql

from tracker.errors import InvalidArgument, InvalidValue
from tracker.inbox import Inbox
from tracker.inbox import retention as r

WAIT_BOUND = 1.0  # seconds


def _expired_partitions(dsn: str, schema: str, n: int, ids: int) -> list[str]:
    """`n` partitions of a past day each, holding `ids` ids, attached as the maintenance would."""
    names = []
    base = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        for i in range(n):
            name, lo, hi = f"inbox_old_{i}", base + datetime.timedelta(days=i), base + datetime.timedelta(days=i + 1)
            c.execute(sql.SQL("CREATE TABLE {} (LIKE inbox INCLUDING DEFAULTS)").format(sql.Identifier(name)))
            c.execute(sql.SQL("CREATE UNIQUE INDEX ON {} (consumer, message_id)").format(sql.Identifier(name)))
            c.execute(
                sql.SQL("ALTER TABLE inbox ATTACH PARTITION {} FOR VALUES FROM ({}) TO ({})").format(
                    sql.Identifier(name), sql.Literal(lo), sql.Literal(hi)
                )
            )
            c.execute("INSERT INTO inbox_partition VALUES (%s, %s, %s)", [name, lo, hi])
            c.execute("INSERT INTO inbox SELECT 'old', 'id-' || g, %s FROM generate_series(1, %s) g", [lo, ids])
            names.append(name)
        c.execute("ANALYZE inbox")
    return names


def test_a_policy_is_checked_and_names_the_value():
    for kwargs in [
        {"bucket": 10},
        {"retention": 0},
        {"retention": 61 * 1000, "bucket": 60},
        {"ahead": -1},
        {"max_drops": 0},
        {"bucket": "1d"},
        {"max_drops": 1.5},
    ]:
        with pytest.raises((InvalidValue, InvalidArgument)) as err:
            r.Retention(**kwargs)
        assert str(next(iter(kwargs.values()))) in str(err.value)


def test_maintain_needs_an_idle_autocommit_connection(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:
        with pytest.raises(InvalidValue, match="autocommit"):
            r.maintain(conn, schema=schema)


@pytest.mark.parametrize("concurrently", [True, False])
def test_expired_partitions_are_dropped_while_consumers_claim_and_no_claim_waits_long(pg_dsn, schema, concurrently):
    expired = _expired_partitions(pg_dsn, schema, 5, 2000)
    box = Inbox("c", schema=schema, registry=None)
    stop = threading.Event()
    pids: set[int] = set()
    claimed: list[int] = []
    errors: list[BaseException] = []

    def writer() -> None:
        n = 0
        try:
            with psycopg.connect(pg_dsn) as conn:
                pids.add(conn.info.backend_pid)
                while not stop.is_set():
                    assert box.claim(conn, uuid.uuid4().hex)
                    conn.commit()
                    n += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        claimed.append(n)

    def long_transaction() -> None:
        # A consumer whose transaction stays open a while: what a DROP would queue behind.
        try:
            with psycopg.connect(pg_dsn) as conn:
                while not stop.is_set():
                    assert box.claim(conn, uuid.uuid4().hex)
                    stop.wait(1.5)
                    conn.commit()
                    claimed.append(1)
                    stop.wait(0.2)  # a gap now and then, as a consumer between messages
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    waits: list[float] = []

    def sampler() -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            while not stop.is_set():
                (w,) = c.execute(
                    "SELECT coalesce(extract(epoch FROM max(clock_timestamp() - waitstart)), 0)::float8"
                    " FROM pg_locks WHERE NOT granted AND pid = ANY(%s)",
                    [list(pids)],
                ).fetchone()
                waits.append(w)
                time.sleep(0.01)

    threads = [threading.Thread(target=writer) for _ in range(3)]
    threads += [threading.Thread(target=long_transaction), threading.Thread(target=sampler)]
    for t in threads:
        t.start()
    policy = r.Retention(retention=86400, bucket=3600, ahead=7200, max_drops=1, lock_timeout=0.3)
    results = []
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as m:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                results.append(r.maintain(m, schema=schema, policy=policy, concurrently=concurrently))
                left = {p.name for p in r.partitions(m, schema=schema)} & set(expired)
                if not left:
                    break
                time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    under_load = [n for res in results for n in res.dropped]
    with psycopg.connect(pg_dsn, autocommit=True) as m:  # the rest, if the long transaction held them off
        for _ in range(10):
            if sorted(n for res in results for n in res.dropped) == sorted(expired):
                break
            results.append(r.maintain(m, schema=schema, policy=policy, concurrently=concurrently))
    assert not errors, errors
    assert under_load, "no partition dropped while consumers were claiming"
    dropped = [n for res in results for n in res.dropped]
    assert sorted(dropped) == sorted(expired), results  # every expired partition went, each once
    assert sum(claimed) > 0 and len(waits) > 10
    assert max(waits) < WAIT_BOUND, f"a claim waited {max(waits):.3f} s for a lock"
    with psycopg.connect(pg_dsn) as c:
        (kept,) = c.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE consumer = 'c'").format(sql.Identifier(schema, "inbox"))
        ).fetchone()
        (old,) = c.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE consumer = 'old'").format(sql.Identifier(schema, "inbox"))
        ).fetchone()
    assert (kept, old) == (sum(claimed), 0)  # nothing claimed was lost; every expired id went


def test_partitions_are_made_ahead_and_a_duplicate_is_found_in_any_partition(pg_dsn, schema):
    with psycopg.connect(pg_dsn, autocommit=True) as m:
        before = {p.name for p in r.partitions(m, schema=schema)}
        got = r.maintain(m, schema=schema, policy=r.Retention(bucket=3600, ahead=10 * 86400))
        after = r.partitions(m, schema=schema)
    assert got.created and set(got.created) == {p.name for p in after} - before
    assert after[-1].upper >= datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=10)
    assert all(a.upper == b.lower for a, b in zip(after, after[1:]))  # no gap, no overlap
    # An id recorded in an older partition is a duplicate for a claim landing in the current one.
    old = _expired_partitions(pg_dsn, schema, 1, 3)[0]
    with psycopg.connect(pg_dsn) as conn:
        assert not Inbox("old", schema=schema, registry=None).claim(conn, "id-2")
        assert [x.partition for x in r.show(conn, "id-2", schema=schema)] == [old]
        assert r.show(conn, "id-2", consumer="other", schema=schema) == []


@pytest.mark.parametrize("round_", range(3))
def test_several_maintainers_at_once_drop_each_expired_partition_once(pg_dsn, schema, round_):
    expired = _expired_partitions(pg_dsn, schema, 4, 10)
    policy = r.Retention(retention=86400, bucket=3600, ahead=86400, max_drops=4)
    results: list[r.MaintenanceResult] = []
    errors: list[BaseException] = []
    go = threading.Barrier(3)

    def maintainer() -> None:
        try:
            with psycopg.connect(pg_dsn, autocommit=True) as m:
                go.wait()
                for _ in range(5):
                    results.append(r.maintain(m, schema=schema, policy=policy))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=maintainer) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    with psycopg.connect(pg_dsn, autocommit=True) as m:
        parts = r.partitions(m, schema=schema)
        tables = {
            n
            for (n,) in m.execute(
                "SELECT relname FROM pg_class WHERE relnamespace = %s::regnamespace AND relname LIKE 'inbox_old%%'",
                [schema],
            ).fetchall()
        }
    assert not tables & set(expired) and not {p.name for p in parts} & set(expired)
    dropped = [n for res in results for n in res.dropped]
    assert sorted(dropped) == sorted(expired)  # each counted by the one maintainer that dropped it
    created = [n for res in results for n in res.created]
    assert len(created) == len(set(created))  # each partition made by one of them
    assert all(a.upper == b.lower for a, b in zip(parts, parts[1:]))


def test_the_reaper_role_maintains_the_inbox_it_does_not_own(pg_dsn, schema):
    # The reaper role runs the maintenance in `reaper run` but does not own the inbox: it cannot
    # detach, so it makes and drops partitions through the owner's SQL functions.
    from support.teardown import drop_role
    from test_roles import login_as

    from tracker import roles

    old = _expired_partitions(pg_dsn, schema, 2, 3)
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        roles.create(admin, schema)
    try:
        with login_as(pg_dsn, schema, "reaper") as conn:
            conn.autocommit = True
            got = r.maintain(conn, schema=schema, policy=r.Retention(bucket=3600, ahead=5 * 86400))
            assert got.created
            assert sorted(got.dropped) == old and got.skipped == []
            assert {p.name for p in r.partitions(conn, schema=schema)}.isdisjoint(old)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            for role in roles.ROLES:
                drop_role(admin, roles.role_name(schema, role))
