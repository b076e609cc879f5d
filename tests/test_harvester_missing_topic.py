"""A topic that does not exist (yet), on brokers that do not create topics: its rows wait, in order,
while every other topic's rows are published; once the topic is created its rows follow, oldest
first. librdkafka refuses such a record in produce() itself once it has learnt the topic is
missing: raised, that refusal remarked from the head again and again, and the oldest row held up
every row behind it, of every topic. Real Kafka and Postgres, both publishing modes."""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest
from confluent_kafka.admin import AdminClient, NewTopic
from support.harness import Receiver, make_config, running, wait_until


def _insert(pg_dsn: str, schema: str, rows: list[tuple[str, bytes, bytes]]) -> list[int]:
    with psycopg.connect(pg_dsn) as c:
        return [
            c.execute(
                f'INSERT INTO "{schema}".outbox (topic, key, value) VALUES (%s, %s, %s) RETURNING id', [t, k, v]
            ).fetchone()[0]
            for t, k, v in rows
        ]


def _left(pg_dsn: str, schema: str) -> list[tuple[int, str]]:
    with psycopg.connect(pg_dsn) as c:
        return c.execute(f'SELECT id, topic FROM "{schema}".outbox ORDER BY id').fetchall()


@pytest.mark.parametrize("fenced", [False, True], ids=["idempotent", "transactional"])
def test_rows_of_a_missing_topic_wait_in_order_and_hold_up_no_other_topic(
    pg_dsn, kafka_bootstrap, schema, topics, fenced
):
    present = topics("present", partitions=2)
    absent = f"absent-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    # the absent topic's rows first (the oldest), then other topics' rows of the same keys
    first = _insert(pg_dsn, schema, [(absent, b"k%d" % (n % 2), b"a%d" % n) for n in range(3)])
    _insert(pg_dsn, schema, [(present, b"k%d" % (n % 2), b"p%d" % n) for n in range(6)])
    on_present = Receiver(kafka_bootstrap, present, 2)
    on_absent = None
    fencing = {"transactional_id": f"t-{uuid.uuid4().hex[:8]}"} if fenced else {}
    # librdkafka holds a record for a topic it does not know this long before it takes the topic
    # for missing (30 s by default), and then refuses the topic's records in produce()
    cfg = make_config(
        pg_dsn,
        schema,
        kafka_bootstrap,
        harvester=fencing,
        kafka={"producer": {"topic.metadata.propagation.max.ms": 500}},
    )
    try:
        with running(cfg) as h:
            assert wait_until(lambda: len(set(on_present.values())) >= 6, 60), on_present.values()
            # more rows of both while the topic is missing, over a while (librdkafka learns the
            # topic is missing and refuses it in produce()): the present topic's still flow
            more = _insert(pg_dsn, schema, [(absent, b"k0", b"a3"), (present, b"k0", b"p6")])
            assert wait_until(lambda: b"p6" in on_present.values(), 30), on_present.values()
            for n in range(7, 11):
                time.sleep(1.0)
                _insert(pg_dsn, schema, [(present, b"k1", b"p%d" % n)])
                assert wait_until(lambda: b"p%d" % n in on_present.values(), 10), (n, _left(pg_dsn, schema))
            # (a delivered row is purged a moment after it arrives)
            assert wait_until(lambda: [t for _, t in _left(pg_dsn, schema)] == [absent] * 4, 30), _left(pg_dsn, schema)
            for f in admin.create_topics([NewTopic(absent, 1, 1)]).values():
                f.result(30)
            on_absent = Receiver(kafka_bootstrap, absent, 1)
            assert wait_until(lambda: not _left(pg_dsn, schema), 60), _left(pg_dsn, schema)
            assert wait_until(lambda: len(set(on_absent.values())) >= 4, 30), on_absent.values()
            assert h.error is None
        # per key, in id order, duplicates allowed: first sightings
        seen: list[bytes] = []
        for v in on_absent.values():
            if v not in seen:
                seen.append(v)
        assert seen == [b"a0", b"a1", b"a2", b"a3"], (seen, first, more)
    finally:
        on_present.close()
        if on_absent is not None:
            on_absent.close()
        for f in admin.delete_topics([absent], operation_timeout=30).values():
            try:
                f.result(30)
            except Exception:  # never created: the test failed before
                pass


def test_in_transactions_a_missing_topic_is_held_before_it_can_stall_the_transaction(
    pg_dsn, kafka_bootstrap, schema, topics
):
    """With librdkafka's default topic.metadata.propagation.max.ms (30 s), a record for a topic it
    does not know waits that long, and its whole transaction, every topic's rows, with it. The
    topics of a transaction's rows are asked about first; a missing one's rows are held."""
    present = topics("present", partitions=1)
    absent = [f"absent-{uuid.uuid4().hex[:10]}" for _ in range(3)]
    _insert(pg_dsn, schema, [(t, b"a", b"x") for t in absent] + [(present, b"p", b"p%d" % n) for n in range(5)])
    on_present = Receiver(kafka_bootstrap, present, 1, {"isolation.level": "read_committed"})
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, harvester={"transactional_id": f"t-{uuid.uuid4().hex[:8]}"})
    try:
        with running(cfg) as h:
            started = time.monotonic()
            assert wait_until(lambda: len(set(on_present.values())) >= 5, 60), on_present.values()
            took = time.monotonic() - started
            assert took < 15, f"the present topic's rows waited {took:.1f} s behind the missing ones"
            assert [t for _, t in _left(pg_dsn, schema)] == absent
            assert h.publisher.txn_aborted == 0 and h.error is None
    finally:
        on_present.close()
