"""A connection that lands on a read-only server (an old primary fenced read-only, or demoted) is
dropped and made anew, so a multi-host DSN with target_session_attrs=read-write finds the primary
again. The server turned read-only is modelled by one session's default_transaction_read_only:
its writes fail with SQLSTATE 25006 exactly as on a fenced server, and only that connection is
affected (the shared Postgres stays writable for everyone else)."""

from __future__ import annotations

import asyncio
import socket
import threading
import uuid

import psycopg
import pytest
from psycopg import errors
from psycopg_pool import PoolTimeout

from harvester.db_pool import make_pool, needs_new_connection, out_of_reach
from harvester.services.claim_settler import ClaimSettler

READ_ONLY = "SET default_transaction_read_only = on"
INSERT = "INSERT INTO \"{}\".outbox (topic, key, value) VALUES ('t', NULL, NULL)"


def test_only_errors_of_the_server_side_ask_for_a_new_connection(pg_dsn, schema):
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(READ_ONLY)
        with pytest.raises(errors.ReadOnlySqlTransaction) as ro:
            conn.execute(INSERT.format(schema))
        with pytest.raises(errors.UndefinedTable) as other:
            conn.execute(f'SELECT * FROM "{schema}".no_such_table')
    assert needs_new_connection(ro.value)
    assert not needs_new_connection(other.value)
    assert not needs_new_connection(ValueError("x"))


def test_an_error_the_server_sent_is_an_answer_and_a_lost_connection_is_not(pg_dsn, schema):
    """What a leader's step-down counts as its database out of reach (harvester.election.step_down)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SET statement_timeout = '10ms'")
        with pytest.raises(errors.QueryCanceled) as cancelled:  # an OperationalError, but an answer
            conn.execute("SELECT pg_sleep(1)")
        conn.execute("SET statement_timeout = 0")
        conn.execute(READ_ONLY)
        with pytest.raises(errors.ReadOnlySqlTransaction) as ro:
            conn.execute(INSERT.format(schema))
        with pytest.raises(errors.UndefinedTable) as missing:
            conn.execute(f'SELECT * FROM "{schema}".no_such_table')
        victim = psycopg.connect(pg_dsn, autocommit=True)
        conn.execute("SELECT pg_terminate_backend(%s)", [victim.info.backend_pid])
        with pytest.raises(psycopg.OperationalError) as terminated:
            victim.execute("SELECT 1")
        victim.close()
    with pytest.raises(psycopg.OperationalError) as closed:  # used after closing
        conn.execute("SELECT 1")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(psycopg.OperationalError) as refused:
        psycopg.connect(f"host=127.0.0.1 port={port} connect_timeout=2")
    pool = make_pool(f"host=127.0.0.1 port={port} connect_timeout=1", 1, name="unreachable", open_wait=None)
    try:
        with pytest.raises(PoolTimeout) as checkout:
            with pool.connection(timeout=0.5):
                pass
    finally:
        pool.close()
    assert not out_of_reach(cancelled.value), cancelled.value.sqlstate
    assert not out_of_reach(missing.value)
    assert not out_of_reach(ValueError("x"))
    for lost in (ro.value, terminated.value, closed.value, refused.value, checkout.value):
        assert out_of_reach(lost), (type(lost), getattr(lost, "sqlstate", None))


def test_the_harvest_pool_replaces_a_connection_to_a_read_only_server(pg_dsn, schema):
    pool = make_pool(pg_dsn, 1, name="t-ro")
    try:
        with pool.connection() as conn:
            conn.execute(READ_ONLY)
            first = conn.info.backend_pid
        with pytest.raises(errors.ReadOnlySqlTransaction):
            with pool.connection() as conn:
                conn.execute(INSERT.format(schema))
        with pool.connection(timeout=10) as conn:
            assert conn.info.backend_pid != first
            conn.execute(INSERT.format(schema))  # writable again: a new connection
    finally:
        pool.close()


def test_the_settler_reconnects_after_a_read_only_error(pg_dsn, schema, monkeypatch):
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # work for the settler: a claim to fold
        conn.execute(f'INSERT INTO "{schema}".ack_claim VALUES (987654321, 1, 0)')
    settler = ClaimSettler(dsn=pg_dsn, schema=schema, interval=0.05)
    made: list[psycopg.Connection] = []
    real_connect = psycopg.connect

    def connect(*args, **kwargs):
        conn = real_connect(*args, **kwargs)
        if not made:
            conn.execute(READ_ONLY)  # the first connection lands on the read-only server
        made.append(conn)
        return conn

    monkeypatch.setattr(psycopg, "connect", connect)
    stop = threading.Event()
    t = threading.Thread(target=settler.run, args=(stop,), daemon=True)
    t.start()
    try:
        deadline = threading.Event()
        for _ in range(100):
            if len(made) >= 2 and settler.stats["passes"] > 0:
                break
            deadline.wait(0.1)
    finally:
        stop.set()
        t.join(10)
    assert settler.stats["errors"] >= 1, settler.stats  # the read-only error was met
    assert len(made) >= 2, f"the settler kept its read-only connection: {settler.stats}"
    assert made[0].closed


def test_the_http_pool_replaces_a_connection_to_a_read_only_server(pg_dsn, schema):
    from harvester.services.http.backend import _PoolStore

    async def scenario() -> None:
        store = _PoolStore(pg_dsn, schema, completion_topic="done", pool_size=1, timeout=10)
        await store.open()
        try:

            async def made_read_only(conn) -> int:
                await conn.execute(READ_ONLY)
                return conn.info.backend_pid

            async def insert(conn) -> int:
                await conn.execute(INSERT.format(schema))
                return conn.info.backend_pid

            first = await store.within(made_read_only)
            with pytest.raises(errors.ReadOnlySqlTransaction):
                await store.within(insert)
            assert await store.within(insert) != first
        finally:
            await store.close()

    asyncio.run(scenario())


def test_the_acker_replaces_a_connection_to_a_read_only_server(pg_dsn, schema, kafka_bootstrap):
    from harvester.services.acker import Acker
    from tracker import fold

    acker = Acker(
        dsn=pg_dsn,
        schema=schema,
        bootstrap_servers=kafka_bootstrap,
        topic="acks-unused",
        group=f"acker-{uuid.uuid4().hex[:8]}",
        dead_letter_topic="acks-dead-unused",
    )
    steps = [(None, fold(["987654321:1:0"]))]
    acker._apply(steps)  # connects
    ro = acker.applier.conn
    assert ro is not None
    ro.execute(READ_ONLY)  # the server behind it turns read-only
    with pytest.raises(errors.ReadOnlySqlTransaction):
        acker._apply(steps)
    assert ro.closed and acker.applier.conn is None
    acker._apply(steps)  # a new connection, writable
    assert acker.applier.conn is not None and acker.applier.conn is not ro
    acker.applier.conn.close()


def test_the_ackers_commits_wait_for_the_wal_and_its_lock_bound_stays_in_its_transaction(
    pg_dsn, schema, kafka_bootstrap
):
    """The acker commits Kafka offsets after its database commit: that commit must be durable even
    where the role turns synchronous_commit off (the advice for the harvester behind a pooler),
    and its lock_timeout must not stay on a session that a transaction pooler hands to others."""
    from harvester.services.acker import Acker
    from tracker import fold

    role_like = f"{pg_dsn}{'&' if '?' in pg_dsn else '?'}options=-c%20synchronous_commit%3Doff"
    acker = Acker(
        dsn=role_like,
        schema=schema,
        bootstrap_servers=kafka_bootstrap,
        topic="acks-unused",
        group=f"acker-{uuid.uuid4().hex[:8]}",
        dead_letter_topic="acks-dead-unused",
    )
    seen: list[tuple[str, str]] = []
    apply = acker.tracker.apply_outcomes

    def watching(conn, *args, **kwargs):
        seen.append(
            conn.execute("SELECT current_setting('synchronous_commit'), current_setting('lock_timeout')").fetchone()
        )
        return apply(conn, *args, **kwargs)

    acker.tracker.apply_outcomes = watching  # type: ignore[method-assign]
    acker._apply([(None, fold(["987654321:1:0"]))])
    conn = acker.applier.conn
    assert conn is not None
    assert seen == [("on", "2s")] and acker.lock_timeout == 2.0
    assert conn.execute("SELECT current_setting('lock_timeout')").fetchone() == ("0",)
    conn.close()


def test_a_stepped_down_reapers_probe_is_not_answered_by_a_read_only_server(pg_dsn):
    """The probe a stepped-down reaper waits on (harvester.election.step_down) must fail where a
    mark would: a read-only server answers SELECT 1, but every mark fails there (25006, which counts
    against the leader), so a probe it answers would rejoin, lead, step down again and so on. The
    read-only connection is dropped, so a multi-host DSN finds the primary again."""
    from types import SimpleNamespace

    from harvester.units import Harvester

    pool = make_pool(pg_dsn, 1, name="t-probe")
    harvester = SimpleNamespace(units=[SimpleNamespace(pool=pool)])  # what Harvester._probe reads
    try:
        Harvester._probe(harvester, 0, 10.0)  # type: ignore[arg-type]
        with pool.connection() as conn:
            conn.execute(READ_ONLY)
            first = conn.info.backend_pid
        with pytest.raises(psycopg.Error) as exc:
            Harvester._probe(harvester, 0, 10.0)  # type: ignore[arg-type]
        assert out_of_reach(exc.value)
        Harvester._probe(harvester, 0, 10.0)  # type: ignore[arg-type]
        with pool.connection(timeout=10) as conn:
            assert conn.info.backend_pid != first
    finally:
        pool.close()
