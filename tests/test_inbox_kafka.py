"""The inbox's Kafka consumer helper end to end, on the real Kafka and Postgres: records delivered
several times (as the reaper delivers duplicates), a crash between the database commit and the
offset commit, a consumer process killed midway and restarted: every effect exactly once. A record
without a message id goes to the dead-letter topic, naming why."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import Consumer, Producer
from psycopg import sql

from tracker.errors import InvalidValue
from tracker.inbox import Inbox
from tracker.inbox.consumer import (
    DEAD_LETTER_REASON_HEADER,
    MESSAGE_ID_HEADER,
    DeadLetterError,
    HandlerEndedTransaction,
    InboxConsumer,
    MissingMessageId,
    message_id_of,
)

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def effects(pg_dsn, schema) -> str:
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        c.execute("CREATE TABLE effects (message_id text NOT NULL, consumer_pid int)")
    return schema


def _produce(bootstrap: str, topic: str, ids: list[str], rng: random.Random, extra: int = 0) -> int:
    """Each id 1 to 3 times (a duplicate as a republication is: same header, same key), in a
    shuffled order, plus `extra` records without a message id. Returns the records produced."""
    records = [i for i in ids for _ in range(rng.randint(1, 3))]
    rng.shuffle(records)
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for mid in records:
        p.produce(topic, key=mid.encode(), value=b"v-" + mid.encode(), headers=[(MESSAGE_ID_HEADER, mid.encode())])
    for n in range(extra):
        p.produce(topic, key=b"x", value=f"no id {n}".encode())
    assert p.flush(30) == 0
    return len(records) + extra


def _effects(dsn: str, schema: str) -> dict[str, int]:
    with psycopg.connect(dsn) as c:
        rows = c.execute(
            sql.SQL("SELECT message_id, count(*) FROM {} GROUP BY 1").format(sql.Identifier(schema, "effects"))
        ).fetchall()
    return dict(rows)


def test_message_id_of_reads_the_header_and_names_what_is_wrong():
    class R:
        def __init__(self, headers):
            self._h = headers

        def headers(self):
            return self._h

    assert message_id_of(R([("a", b"x"), (MESSAGE_ID_HEADER, b"m-1")])) == "m-1"
    # the reaper's header comes after a row's own: a producer's forged id is never the one read
    assert message_id_of(R([(MESSAGE_ID_HEADER, b"forged"), ("a", b"x"), (MESSAGE_ID_HEADER, b"m-2")])) == "m-2"
    with pytest.raises(MissingMessageId, match="message-id"):
        message_id_of(R([("a", b"x")]))
    for bad in [b"", b"x" * 101, "é".encode(), b"a\x00"]:
        with pytest.raises(InvalidValue):
            message_id_of(R([(MESSAGE_ID_HEADER, bad)]))


def test_duplicates_and_a_crash_before_the_offset_commit_run_each_effect_once(pg_dsn, effects, kafka_bootstrap, topics):
    topic, dead = topics("inbox", partitions=3), topics("inbox-dead")
    ids = [f"m-{i}" for i in range(60)]
    produced = _produce(kafka_bootstrap, topic, ids, random.Random(7), extra=2)
    group = f"g-{uuid.uuid4().hex[:8]}"
    config = {"bootstrap.servers": kafka_bootstrap, "group.id": group, "auto.offset.reset": "earliest"}
    insert = sql.SQL("INSERT INTO {} (message_id) VALUES (%s)").format(sql.Identifier(effects, "effects"))
    box = Inbox("billing", schema=effects, registry=None)

    def effect(conn, record):
        conn.execute(insert, [message_id_of(record)])

    with psycopg.connect(pg_dsn) as conn:
        # The first consumer processes what it polls, commits the database, and dies before
        # committing the offsets.
        first = InboxConsumer(config, [topic], conn, box, effect, dead_letter_topic=dead, batch=25)
        records = []
        deadline = time.monotonic() + 30
        while not records and time.monotonic() < deadline:
            records = first.consumer.consume(25, 0.5)
        crashed, _offsets = first.process(records)
        first.consumer.close()
        assert crashed.processed > 0
        # Its successor in the group gets those records again, and everything else.
        second = InboxConsumer(config, [topic], conn, box, effect, dead_letter_topic=dead, batch=25)
        deadline = time.monotonic() + 60
        while second.totals.records < produced and time.monotonic() < deadline:
            second.poll_once()
        second.close()
    assert second.totals.records >= produced
    assert _effects(pg_dsn, effects) == {i: 1 for i in ids}
    assert crashed.processed + second.totals.processed == len(ids)
    assert second.totals.duplicates >= crashed.processed  # the redelivered ones ran nothing
    # The two records without an id are dead letters, with the reason.
    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group + "-d", "auto.offset.reset": "earliest"})
    c.subscribe([dead])
    got = []
    deadline = time.monotonic() + 30
    while len(got) < 2 and time.monotonic() < deadline:
        m = c.poll(0.5)
        if m is not None and m.error() is None:
            got.append(m)
    c.close()
    assert sorted(m.value() for m in got) == [b"no id 0", b"no id 1"]
    reasons = [dict(m.headers())[DEAD_LETTER_REASON_HEADER].decode() for m in got]
    assert all("MissingMessageId" in r and "message-id" in r for r in reasons)


def test_without_a_dead_letter_topic_a_record_without_an_id_stops_the_consumer(
    pg_dsn, effects, kafka_bootstrap, topics
):
    topic = topics("inbox")
    _produce(kafka_bootstrap, topic, [], random.Random(1), extra=1)
    config = {
        "bootstrap.servers": kafka_bootstrap,
        "group.id": f"g-{uuid.uuid4().hex[:8]}",
        "auto.offset.reset": "earliest",
    }
    with psycopg.connect(pg_dsn) as conn:
        c = InboxConsumer(config, [topic], conn, Inbox("c", schema=effects, registry=None), lambda c, r: None)
        try:
            with pytest.raises(MissingMessageId):
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    c.poll_once()
        finally:
            c.close()


def test_a_consumer_killed_midway_and_restarted_runs_each_effect_once(pg_dsn, effects, kafka_bootstrap, topics):
    topic = topics("inbox", partitions=2)
    ids = [f"k-{i}" for i in range(300)]
    _produce(kafka_bootstrap, topic, ids, random.Random(11))
    group = f"g-{uuid.uuid4().hex[:8]}"
    args = [sys.executable, "-m", "support.inbox_consumer", kafka_bootstrap, topic, group, pg_dsn, effects]
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{TESTS.parent}"}
    proc = subprocess.Popen([*args, "30"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(_effects(pg_dsn, effects).values()) < 60:
            time.sleep(0.05)
        assert sum(_effects(pg_dsn, effects).values()) >= 60, "the consumer made no progress"
        proc.send_signal(signal.SIGKILL)  # midway: no offset commit, maybe mid-transaction
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = sum(_effects(pg_dsn, effects).values())
    assert killed_at < len(ids), "it finished before the kill"
    done = subprocess.run([*args, "15"], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert _effects(pg_dsn, effects) == {i: 1 for i in ids}


def _poll_records(c: InboxConsumer, n: int, timeout: float = 30.0) -> None:
    """Poll (records, effects and offsets) until `n` records were processed, or `timeout`."""
    got, deadline = 0, time.monotonic() + timeout
    while got < n and time.monotonic() < deadline:
        got += c.poll_once().records


def _consume(c: InboxConsumer, n: int) -> list:
    records: list = []
    deadline = time.monotonic() + 30
    while len(records) < n and time.monotonic() < deadline:
        records += c.consumer.consume(n - len(records), 0.5)
    assert len(records) == n
    return records


def test_a_dead_letter_the_broker_refuses_moves_no_offset(pg_dsn, effects, kafka_bootstrap, topics):
    # The dead-letter topic takes records of 1,000 bytes at most: the broker refuses this one (a
    # delivery error, not a record left in the producer's queue), so its offset must not move on.
    topic, dead = topics("inbox"), topics("inbox-dead", config={"max.message.bytes": "1000"})
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    p.produce(topic, key=b"x", value=b"v" * 5000)  # no message id: a dead letter
    assert p.flush(30) == 0
    config = {
        "bootstrap.servers": kafka_bootstrap,
        "group.id": f"g-{uuid.uuid4().hex[:8]}",
        "auto.offset.reset": "earliest",
    }
    box = Inbox("billing", schema=effects, registry=None)
    with psycopg.connect(pg_dsn) as conn:
        c = InboxConsumer(config, [topic], conn, box, lambda conn, r: None, dead_letter_topic=dead)
        try:
            records = _consume(c, 1)
            with pytest.raises(DeadLetterError, match="inbox-dead"):
                c.process(records)
        finally:
            c.close()


@pytest.mark.parametrize("ends", ["rollback", "commit"])
def test_a_handler_that_ends_the_transaction_loses_no_record_of_the_poll(
    pg_dsn, effects, kafka_bootstrap, topics, ends
):
    # The helper owns the poll's transaction. A handler that commits or rolls it back itself (the
    # rollback undoing the records before it) must stop the poll with nothing acknowledged, not be
    # taken for a failed record and dead-lettered while the offsets of the undone ones move on.
    topic, dead = topics("inbox"), topics("inbox-dead")
    ids = ["a", "b", "c"]
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for mid in ids:
        p.produce(topic, key=mid.encode(), value=mid.encode(), headers=[(MESSAGE_ID_HEADER, mid.encode())])
    assert p.flush(30) == 0
    group = f"g-{uuid.uuid4().hex[:8]}"
    config = {"bootstrap.servers": kafka_bootstrap, "group.id": group, "auto.offset.reset": "earliest"}
    insert = sql.SQL("INSERT INTO {} (message_id) VALUES (%s)").format(sql.Identifier(effects, "effects"))
    box = Inbox("billing", schema=effects, registry=None)

    def rogue(conn, record):
        conn.execute(insert, [message_id_of(record)])
        if message_id_of(record) == "b":
            getattr(conn, ends)()

    def effect(conn, record):
        conn.execute(insert, [message_id_of(record)])

    with psycopg.connect(pg_dsn) as conn:
        c = InboxConsumer(config, [topic], conn, box, rogue, dead_letter_topic=dead)
        try:
            with pytest.raises(HandlerEndedTransaction):
                c.process(_consume(c, 3))
        finally:
            c.close()
        again = InboxConsumer(config, [topic], conn, box, effect, dead_letter_topic=dead)
        try:
            _poll_records(again, 3)
        finally:
            again.close()
        assert again.totals.dead_lettered == 0
    assert _effects(pg_dsn, effects) == {i: 1 for i in ids}


def test_a_failed_poll_comes_again_on_the_same_consumer(pg_dsn, effects, kafka_bootstrap, topics):
    # Without a dead-letter topic a handler's error rolls the poll back and raises, committing no
    # offset. A caller that goes on polling (a transient error) must get those records again: had
    # the consumer's position stayed past them, the next poll's commit would skip them for good.
    topic = topics("inbox", partitions=2)
    ids = ["a", "b", "c", "d"]
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for n, mid in enumerate(ids):
        p.produce(
            topic, partition=n % 2, key=mid.encode(), value=mid.encode(), headers=[(MESSAGE_ID_HEADER, mid.encode())]
        )
    assert p.flush(30) == 0
    config = {
        "bootstrap.servers": kafka_bootstrap,
        "group.id": f"g-{uuid.uuid4().hex[:8]}",
        "auto.offset.reset": "earliest",
    }
    insert = sql.SQL("INSERT INTO {} (message_id) VALUES (%s)").format(sql.Identifier(effects, "effects"))
    failures = []

    def flaky(conn, record):
        mid = message_id_of(record)
        if mid == "c" and not failures:
            failures.append(mid)
            raise RuntimeError("transient")
        conn.execute(insert, [mid])

    with psycopg.connect(pg_dsn) as conn:
        c = InboxConsumer(config, [topic], conn, Inbox("billing", schema=effects, registry=None), flaky)
        try:
            deadline = time.monotonic() + 30
            while len(_effects(pg_dsn, effects)) < len(ids) and time.monotonic() < deadline:
                try:
                    c.poll_once()
                except RuntimeError:
                    pass
        finally:
            c.close()
    assert failures == ["c"]
    assert _effects(pg_dsn, effects) == {i: 1 for i in ids}


def test_end_of_partition_events_are_not_records_nor_errors(pg_dsn, effects, kafka_bootstrap, topics):
    # With enable.partition.eof (a setting the consumer passes through), librdkafka hands each
    # partition's end to consume() as an event with an error set: the consumer goes on.
    topic = topics("inbox", partitions=2)
    ids = ["a", "b", "c"]
    produced = _produce(kafka_bootstrap, topic, ids, random.Random(3))
    config = {
        "bootstrap.servers": kafka_bootstrap,
        "group.id": f"g-{uuid.uuid4().hex[:8]}",
        "auto.offset.reset": "earliest",
        "enable.partition.eof": True,
    }
    insert = sql.SQL("INSERT INTO {} (message_id) VALUES (%s)").format(sql.Identifier(effects, "effects"))
    with psycopg.connect(pg_dsn) as conn:
        c = InboxConsumer(
            config,
            [topic],
            conn,
            Inbox("billing", schema=effects, registry=None),
            lambda conn, record: conn.execute(insert, [message_id_of(record)]),
        )
        try:
            deadline = time.monotonic() + 30
            polls = 0
            while (c.totals.records < produced or polls < 5) and time.monotonic() < deadline:
                c.poll_once()  # raised KafkaException(_PARTITION_EOF) before
                polls += 1
        finally:
            c.close()
    assert c.totals.records == produced
    assert _effects(pg_dsn, effects) == {i: 1 for i in ids}


def test_a_poll_whose_commit_fails_sends_no_dead_letter_and_the_next_sends_each_once(
    pg_dsn, effects, kafka_bootstrap, topics
):
    """Dead letters go out once the poll's transaction has committed: a poll whose commit fails
    comes again whole, and a dead letter sent before it would go out twice."""
    from support.harness import read_messages

    topic, dead = topics("inbox"), topics("inbox-dead")
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    p.produce(topic, key=b"x", value=b"no id")  # a dead letter
    p.produce(topic, key=b"b", value=b"b", headers=[(MESSAGE_ID_HEADER, b"b")])
    assert p.flush(30) == 0
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        # b's effect breaks a deferred constraint: only the poll's COMMIT fails, after every record ran
        c.execute(
            sql.SQL("CREATE TABLE {} (id int UNIQUE DEFERRABLE INITIALLY DEFERRED)").format(
                sql.Identifier(effects, "once")
            )
        )
    once = sql.SQL("INSERT INTO {} VALUES (1)").format(sql.Identifier(effects, "once"))
    config = {
        "bootstrap.servers": kafka_bootstrap,
        "group.id": f"g-{uuid.uuid4().hex[:8]}",
        "auto.offset.reset": "earliest",
    }
    box = Inbox("billing", schema=effects, registry=None)
    attempts = []

    def effect(conn, record):
        attempts.append(message_id_of(record))
        conn.execute(once)
        if len(attempts) == 1:
            conn.execute(once)  # the duplicate is found at COMMIT

    with psycopg.connect(pg_dsn) as conn:
        c = InboxConsumer(config, [topic], conn, box, effect, dead_letter_topic=dead)
        try:
            with pytest.raises(psycopg.errors.UniqueViolation):
                c.poll_once()
            _poll_records(c, 2)
        finally:
            c.close()
    letters = read_messages(kafka_bootstrap, dead, 2, timeout=10, linger=1.0)
    assert [m.value() for m in letters] == [b"no id"], "a dead letter per delivery of the poll, not per commit"
