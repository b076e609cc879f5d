"""The inbox consumer helper dead-letters a record only for the record's own fault (no usable
message id, a handler that raises for a reason a retry would meet again). An error of the inbox
itself, or one a retry can mend whoever met it, rolls the poll back, commits no offset and sends no
dead letter: the records come again and are processed once the cause is gone. Real Kafka and
Postgres; the faults are real too (the inbox's partitions dropped, a row lock held elsewhere)."""

from __future__ import annotations

import hashlib
import time
import uuid

import psycopg
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from psycopg import sql

from tracker.errors import NoInboxPartition
from tracker.inbox import Inbox
from tracker.inbox.consumer import MESSAGE_ID_HEADER, PASSING_TRIES, InboxConsumer
from tracker.inbox.retention import maintain


@pytest.fixture
def effects(pg_dsn, schema) -> str:
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(sql.SQL("CREATE TABLE {} (message_id text PRIMARY KEY)").format(sql.Identifier(schema, "effects")))
        c.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY)").format(sql.Identifier(schema, "held")))
        c.execute(sql.SQL("INSERT INTO {} VALUES (1)").format(sql.Identifier(schema, "held")))
    return schema


def _produce(bootstrap: str, topic: str, ids: list[str]) -> None:
    p = Producer({"bootstrap.servers": bootstrap})
    for mid in ids:
        p.produce(topic, key=mid.encode(), value=mid.encode(), headers=[(MESSAGE_ID_HEADER, mid.encode())])
    assert p.flush(30) == 0


def _committed(bootstrap: str, group: str, topic: str) -> int:
    k = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        return k.committed([TopicPartition(topic, 0)], timeout=10)[0].offset
    finally:
        k.close()


def _dead_letters(bootstrap: str, topic: str) -> int:
    k = Consumer({"bootstrap.servers": bootstrap, "group.id": f"r-{uuid.uuid4().hex}", "auto.offset.reset": "earliest"})
    try:
        lo, hi = k.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        return hi - lo
    finally:
        k.close()


def _effects(dsn: str, schema: str) -> list[str]:
    with psycopg.connect(dsn) as c:
        q = sql.SQL("SELECT message_id FROM {} ORDER BY 1").format(sql.Identifier(schema, "effects"))
        return [r[0] for r in c.execute(q)]


def _insert(schema: str) -> sql.Composed:
    return sql.SQL("INSERT INTO {} (message_id) VALUES (%s)").format(sql.Identifier(schema, "effects"))


def _consumer(
    conn: psycopg.Connection, bootstrap: str, group: str, topic: str, dead: str, schema: str, effect=None
) -> InboxConsumer:
    """An InboxConsumer of `topic` in `group` with a dead-letter topic; `effect` by default inserts
    the record's value into the schema's effects table."""
    if effect is None:
        insert = _insert(schema)

        def effect(conn: psycopg.Connection, record) -> None:
            conn.execute(insert, [record.value().decode()])

    config = {"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest"}
    return InboxConsumer(
        config, [topic], conn, Inbox("billing", schema=schema, registry=None), effect, dead_letter_topic=dead
    )


def test_no_inbox_partition_rolls_the_poll_back_and_the_records_come_again(pg_dsn, effects, kafka_bootstrap, topics):
    topic, dead = topics("inbox"), topics("inbox-dead")
    _produce(kafka_bootstrap, topic, ["a", "b"])
    with psycopg.connect(pg_dsn, autocommit=True) as c:  # the maintenance has not run for too long
        part = sql.Identifier(effects, "inbox_partition")
        for (name,) in c.execute(sql.SQL("SELECT name FROM {}").format(part)).fetchall():
            c.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(effects, name)))
        c.execute(sql.SQL("DELETE FROM {}").format(part))
    group = f"g-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn) as conn:
        c = _consumer(conn, kafka_bootstrap, group, topic, dead, effects)
        try:
            failed = None
            deadline = time.monotonic() + 60
            while failed is None:
                assert time.monotonic() < deadline, c.totals
                try:
                    got = c.poll_once()
                except NoInboxPartition as exc:
                    failed = exc
                else:
                    assert got.records == 0, f"a poll went through without an inbox partition: {got}"
            # nothing diverted, nothing acknowledged
            assert c.totals.dead_lettered == 0 and _dead_letters(kafka_bootstrap, dead) == 0
            assert _committed(kafka_bootstrap, group, topic) < 0  # no offset committed yet
            with psycopg.connect(pg_dsn, autocommit=True) as upkeep:
                maintain(upkeep, schema=effects)
            deadline = time.monotonic() + 60
            while c.totals.processed < 2:
                assert time.monotonic() < deadline, c.totals
                c.poll_once()
        finally:
            c.close()
    assert _effects(pg_dsn, effects) == ["a", "b"]
    assert _committed(kafka_bootstrap, group, topic) == 2
    assert _dead_letters(kafka_bootstrap, dead) == 0


@pytest.mark.parametrize("fault", ["lock_timeout", "statement_timeout"])
def test_a_handler_meeting_a_passing_database_error_is_retried_not_dead_lettered(
    pg_dsn, effects, kafka_bootstrap, topics, fault
):
    """A lock held elsewhere makes the handler's own statement time out: retried until it is free."""
    topic, dead = topics("inbox"), topics("inbox-dead")
    _produce(kafka_bootstrap, topic, ["a", "b", "c"])
    group = f"g-{uuid.uuid4().hex[:8]}"
    insert = _insert(effects)
    lock = sql.SQL("SELECT id FROM {} WHERE id = 1 FOR UPDATE").format(sql.Identifier(effects, "held"))

    def effect(conn: psycopg.Connection, record) -> None:
        if record.value() == b"b":
            conn.execute(f"SET LOCAL {fault} = '50ms'")
            conn.execute(lock)
        conn.execute(insert, [record.value().decode()])

    expected = psycopg.errors.LockNotAvailable if fault == "lock_timeout" else psycopg.errors.QueryCanceled
    holder = psycopg.connect(pg_dsn)
    holder.execute(lock)  # held until the first failed poll
    with psycopg.connect(pg_dsn) as conn:
        c = _consumer(conn, kafka_bootstrap, group, topic, dead, effects, effect)
        try:
            errors: list[BaseException] = []
            deadline = time.monotonic() + 60
            while c.totals.processed < 3:
                assert time.monotonic() < deadline, (c.totals, errors)
                try:
                    c.poll_once()
                except expected as exc:
                    errors.append(exc)
                    assert c.totals.dead_lettered == 0
                    assert _committed(kafka_bootstrap, group, topic) < 0
                    holder.rollback()  # the lock is free: the next poll gets through
        finally:
            c.close()
            holder.close()
    assert len(errors) == 1
    assert _effects(pg_dsn, effects) == ["a", "b", "c"]
    assert _committed(kafka_bootstrap, group, topic) == 3
    assert c.totals.dead_lettered == 0 and _dead_letters(kafka_bootstrap, dead) == 0


def test_a_handler_that_fails_for_its_own_reason_still_goes_to_the_dead_letter_topic(
    pg_dsn, effects, kafka_bootstrap, topics
):
    """The other side of the rule: a handler's error a retry would meet again (its own bad SQL, a
    constraint, a plain exception) dead-letters the record, and the rest of the poll commits."""
    topic, dead = topics("inbox"), topics("inbox-dead")
    _produce(kafka_bootstrap, topic, ["a", "b", "c", "d"])
    group = f"g-{uuid.uuid4().hex[:8]}"
    insert = _insert(effects)

    def effect(conn: psycopg.Connection, record) -> None:
        if record.value() == b"b":
            conn.execute("SELECT 1 / 0")
        if record.value() == b"c":
            raise ValueError("not an order")
        conn.execute(insert, [record.value().decode()])

    with psycopg.connect(pg_dsn) as conn:
        c = _consumer(conn, kafka_bootstrap, group, topic, dead, effects, effect)
        try:
            deadline = time.monotonic() + 60
            while c.totals.records < 4:
                assert time.monotonic() < deadline, c.totals
                c.poll_once()
        finally:
            c.close()
    assert _effects(pg_dsn, effects) == ["a", "d"]
    assert c.totals.dead_lettered == 2 and _dead_letters(kafka_bootstrap, dead) == 2
    assert _committed(kafka_bootstrap, group, topic) == 4


def _consume_all(consumer: InboxConsumer, records: int, polls: int = 40) -> list[BaseException]:
    """Poll until `records` records went through (processed, duplicates or dead letters); the errors met."""
    errors: list[BaseException] = []
    deadline = time.monotonic() + 90
    while consumer.totals.records < records:
        assert time.monotonic() < deadline and len(errors) < polls, (consumer.totals, errors[-3:])
        try:
            consumer.poll_once()
        except psycopg.Error as exc:
            errors.append(exc)
    return errors


def test_a_handler_error_every_retry_meets_again_dead_letters_the_record_at_once(
    pg_dsn, effects, kafka_bootstrap, topics
):
    """A program limit (a value too large for the handler's index) fails the same way every time: an
    OperationalError by class, but the record's own fault."""
    topic, dead = topics("inbox"), topics("inbox-dead")
    big = "".join(hashlib.sha256(str(i).encode()).hexdigest() for i in range(400))  # incompressible, past a btree row
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for mid, value in [("a", "a"), ("b", big), ("c", "c")]:
        p.produce(topic, key=mid.encode(), value=value.encode(), headers=[(MESSAGE_ID_HEADER, mid.encode())])
    assert p.flush(30) == 0
    group = f"g-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn) as conn:
        c = _consumer(conn, kafka_bootstrap, group, topic, dead, effects)
        try:
            errors = _consume_all(c, 3)
        finally:
            c.close()
    assert errors == []
    assert _effects(pg_dsn, effects) == ["a", "c"] and c.totals.dead_lettered == 1


def test_a_passing_error_only_one_records_work_meets_dead_letters_it_after_a_few_polls(
    pg_dsn, effects, kafka_bootstrap, topics
):
    """A statement timeout that record b's work reaches every time: retried PASSING_TRIES polls,
    then dead-lettered, and the records behind it are processed."""
    topic, dead = topics("inbox"), topics("inbox-dead")
    _produce(kafka_bootstrap, topic, ["a", "b", "c"])
    group = f"g-{uuid.uuid4().hex[:8]}"
    insert = _insert(effects)

    def effect(conn: psycopg.Connection, record) -> None:
        if record.value() == b"b":
            conn.execute("SET LOCAL statement_timeout = '20ms'")
            conn.execute("SELECT pg_sleep(1)")
        conn.execute(insert, [record.value().decode()])

    with psycopg.connect(pg_dsn) as conn:
        c = _consumer(conn, kafka_bootstrap, group, topic, dead, effects, effect)
        try:
            errors = _consume_all(c, 3)
        finally:
            c.close()
    assert len(errors) == PASSING_TRIES - 1 and all(isinstance(e, psycopg.errors.QueryCanceled) for e in errors), errors
    assert _effects(pg_dsn, effects) == ["a", "c"] and c.totals.dead_lettered == 1
    assert _committed(kafka_bootstrap, group, topic) == 3
