"""Outbox rows may not name a topic the reaper reads itself: the leader topic, every ack topic and
the acks' dead-letter topic (whether this process's acker runs or not). Published with the reaper's credentials,
such a row (a SQL producer's `enqueue`, an application's own row) could ack or fail any batch's
items, or disturb the election. It is moved to the dead table with the reason; the other rows go
on. Real Kafka and Postgres, both modes."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from support.harness import Receiver, make_config, outbox_marks, running, wait_until


def _insert(pg_dsn: str, schema: str, rows: list[tuple[str, bytes]]) -> list[int]:
    with psycopg.connect(pg_dsn) as c:
        return [
            c.execute(
                f'INSERT INTO "{schema}".outbox (topic, key, value) VALUES (%s, %s, %s) RETURNING id', [t, b"k", v]
            ).fetchone()[0]
            for t, v in rows
        ]


def _dead(pg_dsn: str, schema: str) -> list[tuple[int, str, str]]:
    with psycopg.connect(pg_dsn) as c:
        return c.execute(f'SELECT id, topic, reason FROM "{schema}".outbox_dead ORDER BY id').fetchall()


@pytest.mark.parametrize("fenced", [False, True], ids=["idempotent", "transactional"])
def test_rows_naming_the_reapers_own_topics_are_quarantined_and_hold_up_nothing(
    pg_dsn, kafka_bootstrap, schema, topics, fenced
):
    data, acks, dead_letters, leader = topics("data"), topics("acks"), topics("acks-dl"), topics("leader")
    fencing = {"transactional_id": f"t-{uuid.uuid4().hex[:8]}"} if fenced else {}
    cfg = make_config(
        pg_dsn,
        schema,
        kafka_bootstrap,
        leader_topic=leader,
        harvester=fencing,
        acker={"topic": acks, "dead_letter_topic": dead_letters},
    )
    rows = [(data, b"d0"), (acks, b"1:0:0-8191"), (data, b"d1"), (dead_letters, b"x"), (leader, b"y"), (data, b"d2")]
    ids = _insert(pg_dsn, schema, rows)
    receiver = Receiver(kafka_bootstrap, data)
    on_acks = Receiver(kafka_bootstrap, acks)
    try:
        with running(cfg) as h:
            assert wait_until(lambda: not outbox_marks(pg_dsn, schema) and len(receiver.values()) >= 3, 60), (
                receiver.values(),
                outbox_marks(pg_dsn, schema),
            )
            assert h.error is None
        dead = _dead(pg_dsn, schema)
        assert [(d[0], d[1]) for d in dead] == [(ids[1], acks), (ids[3], dead_letters), (ids[4], leader)]
        assert all(d[2].startswith("TOPIC_EXCEPTION: a topic the reaper reads itself") for d in dead), dead
        assert receiver.values()[:3] == [b"d0", b"d1", b"d2"]
        assert on_acks.values() == []
    finally:
        receiver.close()
        on_acks.close()


def test_with_this_processs_acker_off_its_topics_stay_reserved(pg_dsn, kafka_bootstrap, schema, topics):
    """Another process's acker, or a Spark ack stream, applies what the ack topic holds."""
    acks, data = topics("acks"), topics("data")
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, acker={"enabled": False, "topic": acks})
    ids = _insert(pg_dsn, schema, [(acks, b"1:0:0"), (data, b"d0")])
    receiver, on_acks = Receiver(kafka_bootstrap, data), Receiver(kafka_bootstrap, acks)
    try:
        with running(cfg):
            assert wait_until(lambda: receiver.values() == [b"d0"] and not outbox_marks(pg_dsn, schema), 60)
        assert [(d[0], d[1]) for d in _dead(pg_dsn, schema)] == [(ids[0], acks)]
        assert on_acks.values() == []
    finally:
        receiver.close()
        on_acks.close()


@pytest.mark.parametrize("fenced", [False, True], ids=["idempotent", "transactional"])
def test_rows_naming_kafkas_internal_topics_are_quarantined_and_hold_up_nothing(
    pg_dsn, kafka_bootstrap, schema, topics, fenced
):
    """The tracker refuses Kafka's internal topics; a row written past it (an application's own
    INSERT) would fail the producer at the broker (an idempotent one for good, a transaction each
    time), holding up every topic. It is moved aside before it is produced."""
    from tracker import KAFKA_INTERNAL_TOPICS

    data = topics("data")
    fencing = {"transactional_id": f"t-{uuid.uuid4().hex[:8]}"} if fenced else {}
    internal = sorted(KAFKA_INTERNAL_TOPICS)
    rows = [(data, b"d0")] + [(t, b"x") for t in internal] + [(data, b"d1")]
    ids = _insert(pg_dsn, schema, rows)
    receiver = Receiver(kafka_bootstrap, data, 1, {"isolation.level": "read_committed"})
    try:
        with running(make_config(pg_dsn, schema, kafka_bootstrap, harvester=fencing)) as h:
            assert wait_until(lambda: not outbox_marks(pg_dsn, schema) and len(receiver.values()) >= 2, 60), (
                receiver.values(),
                outbox_marks(pg_dsn, schema),
            )
            assert h.error is None and h.publisher.retired == 0
        dead = _dead(pg_dsn, schema)
        assert [(d[0], d[1]) for d in dead] == list(zip(ids[1:-1], internal))
        assert all(
            d[2] == "TOPIC_EXCEPTION: one of Kafka's internal topics, which producers may not write" for d in dead
        )
        assert receiver.values() == [b"d0", b"d1"]
    finally:
        receiver.close()
