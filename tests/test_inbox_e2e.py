"""The inbox end to end: a real `reaper run` leader publishes outbox rows (some of whose deliveries are
reported failed although written, so it publishes them again) and is killed mid-stream; the standby
takes over and publishes again what was in flight. Kafka holds duplicates with the same message-id,
and a consumer through tracker.inbox applies each row's effect exactly once; a replay of the whole
topic afterwards (a consumer whose offsets were lost) applies nothing."""

from __future__ import annotations

import collections
import signal
import threading
import time
import uuid

import psycopg
import pytest
from psycopg import sql
from support.faults import FaultPlan
from support.harness import Generator, Receiver, check_published, env_for, make_config, wait_for
from support.reaper import ReaperProcess, stop_all

from tracker import message_id_of
from tracker.inbox import Inbox
from tracker.inbox.consumer import InboxConsumer

PARTITIONS = 3
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("reaper-failover")]


def _consume(bootstrap: str, topic: str, group: str, dsn: str, schema: str, stop: threading.Event, idle: float):
    """Runs an InboxConsumer until `stop` is set and the topic has been idle for `idle` seconds."""
    insert = sql.SQL("INSERT INTO {} (message_id, value) VALUES (%s, %s)").format(sql.Identifier(schema, "effects"))

    def effect(conn: psycopg.Connection, record) -> None:
        conn.execute(insert, [message_id_of(record), record.value()])

    config = {"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest"}
    with psycopg.connect(dsn) as conn:
        consumer = InboxConsumer(config, [topic], conn, Inbox("e2e", schema=schema, registry=None), effect, batch=50)
        last = time.monotonic()
        try:
            while not (stop.is_set() and time.monotonic() - last > idle):
                if consumer.poll_once().records:
                    last = time.monotonic()
        finally:
            consumer.close()
        return consumer.totals


def test_each_effect_once_through_a_leader_kill_and_a_full_replay(pg_dsn, kafka_bootstrap, schema, topics, tmp_path):
    topic, leader_topic = topics("data", partitions=PARTITIONS), topics("leader", partitions=1)
    cfg = make_config(
        pg_dsn,
        schema,
        kafka_bootstrap,
        leader_topic=leader_topic,
        harvester={"mark_batch": 500, "max_in_flight": 5000},
    )
    env = env_for(cfg)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(
            sql.SQL("CREATE TABLE {} (message_id text NOT NULL, value bytea)").format(sql.Identifier(schema, "effects"))
        )
    receiver = Receiver(kafka_bootstrap, topic, PARTITIONS)  # every copy Kafka holds, with its headers
    gen = Generator(pg_dsn, schema, topic, keys=30, per_txn=10).start(rate_per_s=1500)
    stop, results = threading.Event(), {}
    group = f"inbox-e2e-{uuid.uuid4().hex[:8]}"
    worker = threading.Thread(
        target=lambda: results.update(first=_consume(kafka_bootstrap, topic, group, pg_dsn, schema, stop, 3.0))
    )
    # 2% of the leader's deliveries are written yet reported failed: it publishes them again.
    a = ReaperProcess(env, tmp_path / "a.log", faults=FaultPlan(delivery_error_rate=0.02, seed=7))
    b = None
    try:
        assert a.wait_leader(60)
        b = ReaperProcess(env, tmp_path / "b.log")
        worker.start()
        # Killed once Kafka holds a copy it published twice: a fixed 3 s could pass, on a loaded
        # machine, before it published anything, and the test would then prove nothing.
        wait_for(lambda: _duplicated(_copies(receiver.snapshot())) > 0, 120, "a copy the first leader published twice")
        a.signal(signal.SIGKILL)  # what it had in flight is published again by b, same message ids
        a.wait(10)
        assert b.wait_leader(30), "the standby never took over"
        time.sleep(3)
        gen.stop()
        check_published(receiver, gen)
        stop.set()
        worker.join(120)
        assert not worker.is_alive()

        copies = _copies(receiver.records)
        values = {}
        for _, value, headers in receiver.records:
            values[message_id_of(_Headers(headers))] = value
        with psycopg.connect(pg_dsn) as c:
            effects = c.execute(
                sql.SQL("SELECT message_id, value FROM {}").format(sql.Identifier(schema, "effects"))
            ).fetchall()
        applied = collections.Counter(mid for mid, _ in effects)
        assert set(applied) == set(copies), "every published row's effect ran"
        assert max(applied.values()) == 1, [m for m, n in applied.items() if n > 1][:5]
        assert {bytes(v) for _, v in effects} == {v for _, v, _ in receiver.records}
        duplicated = _duplicated(copies)
        assert duplicated > 0, "Kafka delivered no duplicate: the test would prove nothing"
        print(f"{len(copies)} rows, {duplicated} duplicate copies on Kafka, {len(effects)} effects")

        # A consumer that lost its offsets reads everything again: the inbox runs nothing.
        stop2 = threading.Event()
        stop2.set()
        replay = _consume(kafka_bootstrap, topic, f"{group}-replay", pg_dsn, schema, stop2, 3.0)
        assert replay.processed == 0 and replay.duplicates == sum(copies.values())
        with psycopg.connect(pg_dsn) as c:
            again = c.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "effects"))).fetchone()
        assert again == (len(effects),)
    finally:
        stop.set()
        gen.stop()
        stop_all([p for p in (a, b) if p is not None])
        receiver.close()


class _Headers:
    def __init__(self, headers) -> None:
        self._headers = headers

    def headers(self):
        return self._headers


def _copies(records) -> collections.Counter:
    """How many copies of each message id the records hold."""
    return collections.Counter(message_id_of(_Headers(headers)) for _, _, headers in records)


def _duplicated(copies: collections.Counter) -> int:
    """Copies beyond the first."""
    return sum(n - 1 for n in copies.values())
