"""Through the real PgBouncer in transaction pooling mode (deploy/local/services.py): migrations,
the harvester's store, and `reaper run` end to end (harvester + acker + sweeper)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import psycopg
import pytest
from support.teardown import drop_schema

from tracker import schema as schema_mod

# Two tests here hold 20 of PgBouncer's server connections at once: keep them on one worker.
pytestmark = pytest.mark.xdist_group("pgbouncer")


def _drop(pg_dsn: str, name: str) -> None:
    drop_schema(pg_dsn, name)


def _advisory_locks(pg_dsn: str, name: str) -> list[tuple]:
    key = schema_mod.migration_lock_key(name)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT pid, granted FROM pg_locks WHERE locktype = 'advisory' "
            "AND ((classid::bigint << 32) | objid::bigint) = %s",
            [key],
        ).fetchall()


def _migrate_procs(dsns: list[str], name: str) -> list[tuple[int, str, str]]:
    procs = []
    for dsn in dsns:
        env = dict(os.environ, REAPER_DATABASE__DSN=dsn, REAPER_DATABASE__SCHEMA=name)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "harvester.cli", "migrate"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            stderr += "\n(timed out: waiting on a lock that was never released?)"
        out.append((p.returncode, stdout, stderr))
    return out


def test_concurrent_reaper_migrate_through_pgbouncer_and_direct(pg_dsn, pgbouncer_dsn):
    name = f"t_{uuid.uuid4().hex[:12]}"
    try:
        results = _migrate_procs([pgbouncer_dsn, pg_dsn, pgbouncer_dsn, pg_dsn, pgbouncer_dsn], name)
        assert [rc for rc, _, _ in results] == [0] * 5, results
        names = [m.name for m in schema_mod.migrations()] + [d.name for d in schema_mod.definitions()]
        applied = sorted(
            line.split()[1] for _, out, _ in results for line in out.splitlines() if line.startswith("applied ")
        )
        assert applied == sorted(names), results  # each file applied by exactly one process
        with psycopg.connect(pg_dsn) as conn:
            rows = conn.execute(f'SELECT version FROM "{name}".schema_migrations ORDER BY 1').fetchall()
        assert [r[0] for r in rows] == [m.version for m in schema_mod.migrations()]
        # A transaction-level lock ends with its transaction: nothing is left on a pooled server connection.
        assert _advisory_locks(pg_dsn, name) == []
        again = _migrate_procs([pgbouncer_dsn], name)
        assert again[0][0] == 0 and f"schema {name!r} is up to date (0 applied)" in again[0][1], again
    finally:
        _drop(pg_dsn, name)


def test_migrate_through_pgbouncer_on_a_callers_connection_keeps_its_prepare_threshold(pg_dsn, pgbouncer_dsn):
    name = f"t_{uuid.uuid4().hex[:12]}"
    try:
        # The default threshold (5) would have psycopg prepare the per-migration lock statement,
        # which PgBouncer 1.18 cannot carry across transactions; migrate() turns it off while it runs.
        with psycopg.connect(pgbouncer_dsn, autocommit=True) as conn:
            assert schema_mod.migrate(conn, name) == [m.name for m in schema_mod.migrations()] + [
                d.name for d in schema_mod.definitions()
            ]
            assert conn.prepare_threshold == 5
            assert schema_mod.migrate(conn, name) == []
        assert _advisory_locks(pg_dsn, name) == []
    finally:
        _drop(pg_dsn, name)


def test_migrate_through_pgbouncer_still_detects_drift(pg_dsn, pgbouncer_dsn, pgbouncer_schema):
    first = schema_mod.migrations()[0]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            f'UPDATE "{pgbouncer_schema}".schema_migrations SET checksum = %s WHERE version = %s',
            ["0" * 64, first.version],
        )
    with pytest.raises(schema_mod.MigrationDrift, match=first.name):
        schema_mod.migrate(pgbouncer_dsn, pgbouncer_schema)
    assert _advisory_locks(pg_dsn, pgbouncer_schema) == []


# ---------------------------------------------------------------- detecting the pooler


@pytest.mark.parametrize("autocommit", [True, False])
def test_behind_pooler_tells_pgbouncer_from_postgres_and_leaves_the_connection_idle(pg_dsn, pgbouncer_dsn, autocommit):
    from psycopg import pq

    from tracker.pooling import behind_pooler, configure_for_pooler

    for dsn, expected in ((pg_dsn, False), (pgbouncer_dsn, True)):
        with psycopg.connect(dsn, autocommit=autocommit) as conn:
            assert behind_pooler(conn) is expected
            assert conn.info.transaction_status == pq.TransactionStatus.IDLE
            assert configure_for_pooler(conn) is expected
            assert conn.prepare_threshold == (None if expected else 5)


def test_pool_through_pgbouncer_runs_each_store_statement_many_times(pgbouncer_dsn, pgbouncer_schema):
    import contextlib

    from support.harness import insert_rows

    from harvester.publishing.outbox_sql import FOREVER, OutboxStore, make_pool

    @contextlib.contextmanager
    def other_server(on: bool):
        # PgBouncer hands out the server connection released last. An open transaction elsewhere
        # holds that one, so the store's next statement runs on another server connection: every
        # other call, the store moves between two servers, as it would under load.
        if not on:
            yield
            return
        with psycopg.connect(pgbouncer_dsn, prepare_threshold=None) as hog:
            hog.execute("SELECT 1")
            yield

    pool = make_pool(pgbouncer_dsn, 2, name="pgb-test")
    try:
        store = OutboxStore(pool, pgbouncer_schema)
        me = uuid.uuid4()
        with psycopg.connect(pgbouncer_dsn, prepare_threshold=None) as conn:
            insert_rows(conn, pgbouncer_schema, "t", [(b"k", b"%d" % i) for i in range(40)])
        for i in range(12):  # twice psycopg's default prepare threshold
            with other_server(i % 2 == 1):
                rows = store.mark(me, 2, until=FOREVER)
            assert len(rows) == 2
            with other_server(i % 2 == 0):
                assert store.reset(me, [rows[1][0]]) == 1
            with other_server(i % 2 == 1):
                assert store.purge(me, [rows[0][0]]) == 1
            with other_server(i % 2 == 0):
                store.vacuum()
            with other_server(i % 2 == 1):
                assert store.backlog().rows == 40 - (i + 1)
    finally:
        pool.close()


# ---------------------------------------------------------------- the tracker API through PgBouncer


def test_tracker_api_through_pgbouncer_commits_and_rolls_back_with_the_callers_transaction(
    pg_dsn, pgbouncer_dsn, pgbouncer_schema
):
    """A smoke test of the API in the caller's (non-autocommit) transaction; the full connection-mode
    matrix runs through PgBouncer in the tracker's own tests."""
    import tracker
    from tracker import outbox

    schema = pgbouncer_schema
    _reconnect_servers(pgbouncer_dsn)
    with psycopg.connect(pgbouncer_dsn, prepare_threshold=None) as conn:
        for _ in range(7):  # past psycopg's default prepare threshold
            batch = tracker.open_batch(conn, schema=schema)
            handles = outbox.enqueue(conn, batch, [b"a", b"b", b"c"], topic="t", schema=schema)
            handles += tracker.add_items(conn, batch, 2, schema=schema)
            assert tracker.close_batch(conn, batch, schema=schema) is False
            conn.commit()
            ids = [f"{batch.id}:{h.group_id}:{i}" for h in handles for i in range(h.start, h.upto)]
            assert tracker.ack(conn, ids[1:], schema=schema).acked == len(ids) - 1
            done = tracker.exactly_once(conn, ids[0], lambda c: c.execute("SELECT 1").fetchone()[0], schema=schema)
            assert done.first_time and done.value == 1
            conn.commit()
            assert tracker.status(conn, batch, schema=schema).state == "complete"
            conn.rollback()
        batch = tracker.open_batch(conn, schema=schema)
        outbox.enqueue(conn, batch, [b"x"] * 4, topic="gone", schema=schema)
        conn.rollback()
    with psycopg.connect(pg_dsn) as direct:
        assert direct.execute(f'SELECT count(*) FROM "{schema}".batch WHERE id = %s', [batch.id]).fetchone()[0] == 0
        assert direct.execute(f"SELECT count(*) FROM \"{schema}\".outbox WHERE topic = 'gone'").fetchone()[0] == 0
        assert direct.execute(f"SELECT count(*) FROM \"{schema}\".batch WHERE state = 'complete'").fetchone()[0] == 7
    assert set(_server_settings(pgbouncer_dsn, "search_path")) == {'"$user", public'}


def test_tracker_api_through_pgbouncer_with_a_sqlalchemy_session(pg_dsn, pgbouncer_dsn, pgbouncer_schema):
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    import tracker
    from tracker import outbox

    schema = pgbouncer_schema
    # docs/howto/sqlalchemy.md's engine: prepare_threshold=None reaches psycopg through connect_args.
    engine = create_engine(
        pgbouncer_dsn.replace("postgresql://", "postgresql+psycopg://"), connect_args={"prepare_threshold": None}
    )
    try:
        for _ in range(7):
            with Session(engine) as session:
                batch = tracker.open_batch(session, schema=schema)
                handles = outbox.enqueue(session, batch, [b"a", b"b"], topic="t", schema=schema)
                tracker.close_batch(session, batch, schema=schema)
                session.commit()
                ids = [f"{batch.id}:{h.group_id}:{i}" for h in handles for i in range(h.start, h.upto)]
                assert tracker.ack(session, ids, schema=schema).acked == 2
                session.commit()
                assert tracker.status(session, batch, schema=schema).state == "complete"
    finally:
        engine.dispose()
    with psycopg.connect(pg_dsn) as direct:
        assert direct.execute(f"SELECT count(*) FROM \"{schema}\".batch WHERE state = 'complete'").fetchone()[0] == 7


# ---------------------------------------------------------------- `reaper run` through PgBouncer


def _through_pgbouncer(dsn: str, **kw) -> psycopg.Connection:
    # The connection options an application needs through PgBouncer < 1.21 in transaction mode.
    return psycopg.connect(dsn, prepare_threshold=None, **kw)


def _server_settings(pgbouncer_dsn: str, setting: str, clients: int = 20) -> list[str]:
    """`setting` as every server connection of PgBouncer's pool sees it: `clients` open transactions
    at once hold `clients` distinct server connections (default_pool_size is 20)."""
    conns = [_through_pgbouncer(pgbouncer_dsn) for _ in range(clients)]
    try:
        return [c.execute(f"SHOW {setting}").fetchone()[0] for c in conns]
    finally:
        for c in conns:
            c.close()


def _reconnect_servers(pgbouncer_dsn: str) -> None:
    """Have PgBouncer replace its server connections (gracefully, each once released): no session
    state from an earlier client survives into this test."""
    admin = psycopg.conninfo.make_conninfo(pgbouncer_dsn, dbname="pgbouncer")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("RECONNECT")


def test_reaper_run_through_pgbouncer_publishes_acks_sweeps_and_leaks_no_session_state(
    pg_dsn, pgbouncer_dsn, pgbouncer_schema, kafka_bootstrap, topics, tmp_path
):
    import urllib.request

    from confluent_kafka import Producer
    from support.harness import Receiver, insert_rows, wait_until
    from support.ports import free_port
    from support.reaper import ReaperProcess

    import tracker
    from tracker import outbox
    from tracker.consumer import ITEM_ID_HEADER

    schema = pgbouncer_schema
    _reconnect_servers(pgbouncer_dsn)
    assert set(_server_settings(pgbouncer_dsn, "synchronous_commit")) == {"on"}
    data, done, acks, dlq = topics("data"), topics("done"), topics("acks"), topics("dlq")
    port = free_port()
    env = {
        "REAPER_DATABASE__DSN": pgbouncer_dsn,
        "REAPER_DATABASE__SCHEMA": schema,
        "REAPER_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap,
        "REAPER_HARVESTER__LEADER_TOPIC": f"leader-{uuid.uuid4().hex[:10]}",
        "REAPER_HARVESTER__LEADER_GROUP": f"g-{uuid.uuid4().hex[:8]}",
        "REAPER_HARVESTER__MARK_BATCH": "50",
        "REAPER_HARVESTER__PURGE_BATCH": "20",
        "REAPER_HARVESTER__VACUUM_INTERVAL": "0.2",
        "REAPER_ACKER__ENABLED": "true",
        "REAPER_ACKER__TOPIC": acks,
        "REAPER_ACKER__DEAD_LETTER_TOPIC": dlq,
        "REAPER_ACKER__GROUP": f"a-{uuid.uuid4().hex[:8]}",
        "REAPER_SWEEPER__ENABLED": "true",
        "REAPER_SWEEPER__INTERVAL": "0.3",
        "REAPER_SWEEPER__IDLE_EXPIRY": "3",
        "REAPER_METRICS__ENABLED": "true",
        "REAPER_METRICS__HOST": "127.0.0.1",
        "REAPER_METRICS__PORT": str(port),
        "REAPER_METRICS__BACKLOG_INTERVAL": "0.2",
    }
    reaper = ReaperProcess(env, tmp_path / "reaper.log")
    receiver = Receiver(kafka_bootstrap, data)
    completions = Receiver(kafka_bootstrap, done)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    try:
        assert reaper.wait_leader(60), reaper.log_path.read_text()[-3000:]
        # Plain rows and tracked batches, all written through PgBouncer, in many transactions so
        # that every statement on both sides runs well past psycopg's default prepare threshold (5).
        expected: set[tuple[bytes, bytes]] = set()
        batches = []
        with _through_pgbouncer(pgbouncer_dsn) as conn:
            for r in range(8):
                rows = [(b"k%d" % (i % 3), b"plain-%d-%d" % (r, i)) for i in range(25)]
                insert_rows(conn, schema, data, rows)
                expected.update(rows)
                batch = tracker.open_batch(conn, completion_topic=done, user_key=f"u{r}", schema=schema)
                outbox.enqueue(
                    conn, batch, [f"item-{r}-{i}" for i in range(10)], topic=data, key=b"b%d" % r, schema=schema
                )
                tracker.close_batch(conn, batch, schema=schema)
                conn.commit()
                batches.append(batch)
                expected.update((b"b%d" % r, f"item-{r}-{i}".encode()) for i in range(10))
            # left open: the sweeper expires it and announces that on its completion topic
            idle = tracker.open_batch(conn, completion_topic=done, schema=schema)
            conn.commit()
        assert receiver.wait_for(expected, 60), (len(receiver.unique()), len(expected))

        # The acker acks through PgBouncer: one batch per poll, so its statements repeat too.
        item_ids: dict[int, list[bytes]] = {}
        for _, _, headers in receiver.records:
            item = dict(headers).get(ITEM_ID_HEADER)
            if item is not None:
                item_ids.setdefault(int(item.split(b":")[0]), []).append(item)
        assert sorted(item_ids) == sorted(b.id for b in batches)
        for batch in batches:
            for item in item_ids[batch.id]:
                producer.produce(acks, key=str(batch.id).encode(), value=item)
            assert producer.flush(30) == 0
            assert wait_until(
                lambda: (
                    tracker.status(conn_direct := psycopg.connect(pg_dsn), batch.id, schema=schema).state == "complete"
                    and conn_direct.close() is None
                ),
                30,
            ), f"batch {batch.id} never completed"
        # Completion events went out through the outbox, harvested through PgBouncer.
        assert wait_until(lambda: {k for k, _, _ in completions.records} >= {str(b.id).encode() for b in batches}, 30)

        with psycopg.connect(pg_dsn) as conn:
            assert wait_until(lambda: tracker.status(conn, idle.id, schema=schema).state == "expired", 30)
            conn.rollback()
            assert wait_until(
                lambda: (
                    conn.execute(f'SELECT count(*) FROM "{schema}".outbox').fetchone()[0] == 0
                    and conn.rollback() is None
                ),
                30,
            )

        def backlog_lines() -> list[str]:
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            return [m for m in metrics.splitlines() if m.startswith("reaper_outbox_backlog_rows")]

        # the gauge is sampled every BACKLOG_INTERVAL: its last sample may predate the last purge
        assert wait_until(lambda: backlog_lines() == ["reaper_outbox_backlog_rows 0.0"], 30), backlog_lines()
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5).status == 200
        # The reaper's connections set nothing on PgBouncer's shared server connections.
        assert set(_server_settings(pgbouncer_dsn, "synchronous_commit")) == {"on"}
        assert reaper.terminate(60) == 0
    finally:
        reaper.kill()
        receiver.close()
        completions.close()
    events = reaper.events()
    # Before the fix: "mark failed", "gauge refresh failed", "sweep failed" (prepared statements).
    failed = [e for e in events if e.get("level") == "error" or "failed" in e.get("event", "") or "error" in e]
    assert failed == [], failed[:5]
    assert {e["pool"] for e in events if e.get("event", "").startswith("database reached through a pooler")} == {
        "reaper-aux",
        "reaper-harvester-default",  # one pool per harvest unit
    }
    stopped = next(e for e in events if e.get("event") == "acker stopped")
    assert stopped["acked"] == 80 and stopped["retries"] == 0, stopped


# ---------------------------------------------------------------- the local service itself


@pytest.mark.slow
def test_private_pgbouncer_starts_stops_and_restarts_idempotently_in_transaction_mode():
    from support.private_services import SERVICES, PrivateServices

    private = PrivateServices()
    try:
        private.up(only="postgres")
        for attempt in range(2):  # the second `up` finds it running
            r = subprocess.run(
                [sys.executable, str(SERVICES), "up", "--only", "pgbouncer"],
                env=private.env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert r.returncode == 0, r.stderr
            assert f"PGBOUNCER_DSN={private.pgbouncer_dsn}" in r.stdout.splitlines()
            assert ("already running" in r.stdout) == (attempt == 1), r.stdout
        ini = (private.dir / "pgbouncer" / "pgbouncer.ini").read_text()
        assert "pool_mode = transaction" in ini and f"listen_port = {private.pgbouncer_port}" in ini
        with psycopg.connect(private.pgbouncer_dsn, autocommit=True, prepare_threshold=None) as conn:
            pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
            assert pid != conn.info.backend_pid  # a pooler answered the startup, not Postgres
            owner = subprocess.run(
                ["ps", "-o", "user=", "-p", (private.dir / "pgbouncer" / "pgbouncer.pid").read_text().strip()],
                capture_output=True,
                text=True,
            ).stdout.strip()
            assert owner and owner != "root"
        status = subprocess.run(
            [sys.executable, str(SERVICES), "status"], env=private.env, capture_output=True, text=True, timeout=60
        ).stdout
        assert f"pgbouncer: up {private.pgbouncer_dsn}" in status
        private.down(only="pgbouncer")
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(private.pgbouncer_dsn, connect_timeout=3)
        with psycopg.connect(private.dsn, connect_timeout=10) as conn:  # Postgres stays up
            conn.execute("SELECT 1")
        private.up(only="pgbouncer")
        with psycopg.connect(private.pgbouncer_dsn, connect_timeout=10, prepare_threshold=None) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        private.destroy()


@pytest.mark.parametrize("via", ["direct", "pgbouncer"])
def test_a_vacuum_postgres_skipped_is_told_apart_from_one_that_ran(pg_dsn, pgbouncer_dsn, schema, via):
    """VACUUM (SKIP_LOCKED) says only in a WARNING that it skipped a locked table (a lane index
    build or drop, DDL): the store reports it, so the upkeep counts only the vacuums that ran."""
    from harvester.publishing.outbox_sql import OutboxStore, make_pool

    pool = make_pool(pgbouncer_dsn if via == "pgbouncer" else pg_dsn, 1, name="vacuum-skip")
    try:
        store = OutboxStore(pool, schema)
        assert store.vacuum() is True
        with psycopg.connect(pg_dsn) as holder:
            holder.execute(f'LOCK TABLE "{schema}".outbox IN SHARE UPDATE EXCLUSIVE MODE')
            assert store.vacuum() is False
        assert store.vacuum() is True
    finally:
        pool.close()
