"""Smoke tests of the properties the product relies on, against the real Postgres and Kafka."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import psycopg
import pytest
from confluent_kafka import Consumer, Producer
from support.teardown import drop_schema

from tracker import schema as schema_mod
from tracker.errors import InvalidIdentifier


def test_idempotent_producer_round_trip_with_headers_and_nulls(kafka_bootstrap, topics):
    topic = topics("smoke", partitions=1)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True, "linger.ms": 5})
    reports = []
    sent = [
        (b"k1", b"v1", [("item-id", b"1:0:0"), ("bin", bytes(range(256)))]),
        (b"k1", None, [("tombstone", b"")]),  # null value
        (None, b"no key", []),
    ]
    for key, value, headers in sent:
        producer.produce(topic, key=key, value=value, headers=headers, on_delivery=lambda err, msg: reports.append(err))
    assert producer.flush(30) == 0
    assert reports == [None, None, None]

    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"g-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    got = []
    deadline = time.monotonic() + 30
    while len(got) < 3 and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and not msg.error():
            got.append((msg.key(), msg.value(), msg.headers() or []))
    consumer.close()
    assert got == [(k, v, h) for k, v, h in sent]


def _group_member(bootstrap: str, topic: str, group: str, session_ms: int) -> dict:
    return {
        "bootstrap.servers": bootstrap,
        "group.id": group,
        "session.timeout.ms": session_ms,
        "heartbeat.interval.ms": max(100, session_ms // 10),
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        # The default range assignor may hand partition 0 to a member that merely joins;
        # sticky assignment keeps it with its holder, which leader election needs.
        "partition.assignment.strategy": "cooperative-sticky",
    }


def _wait_assigned(consumer: Consumer, timeout: float) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        consumer.poll(0.05)
        if any(tp.partition == 0 for tp in consumer.assignment()):
            return time.monotonic() - started
    return None


def test_partition_zero_moves_when_holder_closes(kafka_bootstrap, topics):
    topic = topics("leader", partitions=1)
    group = f"g-{uuid.uuid4().hex}"
    first = Consumer(_group_member(kafka_bootstrap, topic, group, 6000))
    first.subscribe([topic])
    assert _wait_assigned(first, 30) is not None
    second = Consumer(_group_member(kafka_bootstrap, topic, group, 6000))
    second.subscribe([topic])
    for _ in range(20):  # let the second join; the holder keeps partition 0
        second.poll(0.05)
        first.poll(0.05)
    assert not second.assignment()
    first.close()  # leaves the group: the handover does not wait for the session timeout
    moved = _wait_assigned(second, 15)
    second.close()
    assert moved is not None, "partition 0 never moved to the remaining member"
    print(json.dumps({"handover_after_close_s": round(moved, 3)}))
    assert moved < 6.0


HOLDER = textwrap.dedent("""
    import sys, time
    from confluent_kafka import Consumer
    bootstrap, topic, group, session_ms = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "session.timeout.ms": session_ms,
                  "heartbeat.interval.ms": max(100, session_ms // 10), "enable.auto.commit": False,
                  "partition.assignment.strategy": "cooperative-sticky"})
    c.subscribe([topic])
    while True:
        c.poll(0.05)
        if c.assignment():
            print("assigned", flush=True)
            break
    while True:
        c.poll(0.05)
""")


def test_partition_zero_moves_after_holder_is_killed(kafka_bootstrap, topics):
    session_ms = 3000
    topic = topics("leader", partitions=1)
    group = f"g-{uuid.uuid4().hex}"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, kafka_bootstrap, topic, group, str(session_ms)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "assigned"
        standby = Consumer(_group_member(kafka_bootstrap, topic, group, session_ms))
        standby.subscribe([topic])
        for _ in range(20):
            standby.poll(0.05)
        assert not standby.assignment()
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        moved = _wait_assigned(standby, session_ms / 1000 * 4 + 10)
        standby.close()
    finally:
        holder.kill()
    assert moved is not None, "partition 0 never moved after the holder was killed"
    print(json.dumps({"session_timeout_s": session_ms / 1000, "reassign_after_sigkill_s": round(moved, 3)}))
    # The group coordinator only notices the dead member when its session expires.
    assert session_ms / 1000 * 0.8 <= moved <= session_ms / 1000 + 3.0


def _table_state(conn: psycopg.Connection, schema: str) -> list[tuple]:
    return conn.execute(
        "SELECT table_name, column_name, data_type FROM information_schema.columns "
        "WHERE table_schema = %s ORDER BY 1, 2",
        [schema],
    ).fetchall()


def test_migrations_applied_twice_change_nothing(pg_dsn, schema):
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        before = _table_state(conn, schema)
        versions = conn.execute(f'SELECT version, applied_at FROM "{schema}".schema_migrations ORDER BY 1').fetchall()
        assert schema_mod.migrate(conn, schema) == []
        assert _table_state(conn, schema) == before
        assert (
            conn.execute(f'SELECT version, applied_at FROM "{schema}".schema_migrations ORDER BY 1').fetchall()
            == versions
        )
        assert [v for v, _ in versions] == [m.version for m in schema_mod.migrations()]
        assert {"outbox", "batch", "batch_group"} <= {t for t, _, _ in before}


def test_migrate_rejects_bad_schema_name(pg_dsn):
    with pytest.raises(InvalidIdentifier, match="x; DROP TABLE"):
        schema_mod.migrate(pg_dsn, "x; DROP TABLE outbox")


def test_three_concurrent_reaper_migrate_processes_all_succeed(pg_dsn):
    name = f"t_{uuid.uuid4().hex[:12]}"
    env = dict(os.environ, REAPER_DATABASE__DSN=pg_dsn, REAPER_DATABASE__SCHEMA=name)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "harvester.cli", "migrate"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = [(p.wait(60), *p.communicate()) for p in procs]
    try:
        assert [rc for rc, _, _ in results] == [0, 0, 0], results
        applied = sum(out.count("applied 0") for _, out, _ in results)
        assert applied == len(schema_mod.migrations()), results  # each file applied by exactly one process
        with psycopg.connect(pg_dsn) as conn:
            rows = conn.execute(f'SELECT version FROM "{name}".schema_migrations ORDER BY 1').fetchall()
        assert [r[0] for r in rows] == [m.version for m in schema_mod.migrations()]
    finally:
        drop_schema(pg_dsn, name)


def test_migrate_dry_run_prints_sql_and_changes_nothing(pg_dsn):
    name = f"t_{uuid.uuid4().hex[:12]}"
    env = dict(os.environ, REAPER_DATABASE__DSN=pg_dsn, REAPER_DATABASE__SCHEMA=name)
    r = subprocess.run(
        [sys.executable, "-m", "harvester.cli", "migrate", "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "CREATE TABLE outbox" in r.stdout and f'SET LOCAL search_path TO "{name}"' in r.stdout
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", [name]).fetchone() is None
