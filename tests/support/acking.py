"""The acker in a test: one on a test's schema and topics, run on a thread, and what a test reads
back from Kafka and Postgres about it (committed and end offsets, a batch's state)."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator

import psycopg
from confluent_kafka import Consumer, Producer, TopicPartition

import tracker
from harvester.services.acker import Acker


def make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq, group=None, **kw) -> Acker:
    return Acker(
        dsn=pg_dsn,
        schema=schema,
        bootstrap_servers=kafka_bootstrap,
        kafka_client=kw.pop("kafka_client", {}),
        topic=topic,
        group=group or f"acker-{uuid.uuid4().hex[:8]}",
        dead_letter_topic=dlq,
        max_poll_records=kw.pop("max_poll_records", 10_000),
        poll_timeout=0.1,
        **kw,
    )


@contextlib.contextmanager
def running(acker: Acker) -> Iterator[threading.Event]:
    stop = threading.Event()
    errors: list[BaseException] = []

    def target():
        try:
            acker.run(stop)
        except BaseException as exc:  # surfaced by the test
            errors.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    try:
        yield stop
    finally:
        stop.set()
        t.join(60)
        assert not t.is_alive(), "acker did not stop"
        assert not errors, errors


def batch_state(pg_dsn, schema, batch_id):
    with psycopg.connect(pg_dsn) as c:
        return c.execute(f'SELECT state, pending FROM "{schema}".batch WHERE id = %s', [batch_id]).fetchone()


def committed(kafka_bootstrap, group, topic, partitions) -> list[int]:
    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        # -1001: nothing committed, which for an empty partition is the same as its end, 0
        return [
            max(tp.offset, 0) for tp in c.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=30)
        ]
    finally:
        c.close()


def end_offsets(kafka_bootstrap, topic, partitions) -> list[int]:
    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "probe"})
    try:
        return [c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in range(partitions)]
    finally:
        c.close()


def produce_raw(kafka_bootstrap, topic, pairs) -> None:
    p = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    for key, value in pairs:
        p.produce(topic, key=key, value=value)
    assert p.flush(30) == 0


def closed_batch(pg_dsn, schema, n):
    with psycopg.connect(pg_dsn) as c:
        b = tracker.open_batch(c, schema=schema)
        handles = tracker.add_items(c, b, n, schema=schema)
        tracker.close_batch(c, b, schema=schema)
        c.commit()
    return b, handles
