"""Failures through the ack topic read by Spark, against the real Postgres (and the standalone cluster,
or OUTBOX_SPARK_MASTER, e.g. local[2,2]): records as Spark's Kafka source gives them applied in
each partition's order, as the reaper's acker applies them (an item's first outcome wins), with
their reasons; then the streaming job over a real topic, bad failures dead-lettered as written."""

from __future__ import annotations

import psycopg
import pytest
from support.harness import read_messages, wait_for
from support.spark import make_session
from test_tracker_support import completion_events, invariant_violations

import tracker
from tracker import spark as tspark
from tracker.consumer import AckProducer

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]

RECORD = "ack binary, key binary, partition int, offset long, headers array<struct<key:string,value:binary>>"


@pytest.fixture(scope="module")
def spark(services):
    session = make_session(
        "tracker-ack-topic-failure-tests",
        conf={"spark.sql.shuffle.partitions": "4", "spark.default.parallelism": "4", "spark.task.maxFailures": "2"},
    )
    yield session
    session.stop()


def _batch(pg_dsn, schema, n):
    with psycopg.connect(pg_dsn) as c:
        b = tracker.open_batch(c, schema=schema)
        tracker.add_items(c, b, n, schema=schema)
        tracker.close_batch(c, b, schema=schema)
        c.commit()
    return b.id


def _decided(pg_dsn, schema, batch_id):
    """(succeeded, failed, pending) counts and item -> reason of the failed items."""
    with psycopg.connect(pg_dsn) as c:
        s = tracker.status(c, batch_id, schema=schema)
        page = tracker.failures(c, batch_id, limit=1000, schema=schema)
        return (s.succeeded, s.failed, s.pending), dict(page.items)


def test_records_apply_in_partition_order_first_outcome_wins_with_reasons(spark, pg_dsn, schema):
    b, other = _batch(pg_dsn, schema, 10), _batch(pg_dsn, schema, 4)
    timeout, bad_row = [("failure-reason", b"timeout")], [("failure-reason", b"bad row")]
    # (value, headers) in partition order: b's in partition 0, other's in partition 1
    p0 = [
        (f"{b}:0:0-2", None),  # acked first: 0, 1, 2
        (f"!{b}:0:2,!{b}:0:3", timeout),  # 2 already acked: a duplicate; 3 fails (timeout)
        (f"!{b}:0:3-4", bad_row),  # 3 failed first under timeout; 4 fails (bad row)
        (f"{b}:0:4,{b}:0:5", None),  # 4 failed: a duplicate; 5 acked
        (f"!{b}:0:6", timeout),
        (f"!{b}:0:6", bad_row),  # a duplicate: 6 keeps timeout
        (f"!{b}:0:7", None),  # no failure-reason: dead-lettered whole
        (f"!{b}:9:0", timeout),  # unknown group: rejected, dead-lettered as a failure
    ]
    p1 = [(f"!{other}:0:0", bad_row), (f"{other}:0:0-3", None)]
    rows = [
        (v.encode(), str(b).encode(), part, off, [{"key": k, "value": x} for k, x in h] if h else None)
        for part, records in ((0, p0), (1, p1))
        for off, (v, h) in enumerate(records)
    ]
    # shuffled over several partitions: the order is rebuilt from (partition, offset)
    df = spark.createDataFrame(rows[::-1], RECORD).repartition(3)
    got = tspark.ordered_outcomes(df, dsn=pg_dsn, schema=schema)
    assert (got.acked, got.failed, got.duplicates) == (4 + 3, 3 + 1, 4 + 1)
    assert got.completed == [other]
    letters = {entry: (why, failure) for entry, why, failure in got.letters}
    assert letters[f"!{b}:0:7"][0].startswith("invalid failure") and letters[f"!{b}:0:7"][1] is None
    assert letters[f"!{b}:9:0"] == ("unknown group", b"timeout")
    assert _decided(pg_dsn, schema, b) == (
        (4, 3, 3),
        {f"{b}:0:3": "timeout", f"{b}:0:4": "bad row", f"{b}:0:6": "timeout"},
    )
    assert _decided(pg_dsn, schema, other) == ((3, 1, 0), {f"{other}:0:0": "bad row"})
    again = tspark.ordered_outcomes(df, dsn=pg_dsn, schema=schema)  # a replayed micro-batch
    assert (again.acked, again.failed, again.completed) == (0, 0, [])
    with psycopg.connect(pg_dsn) as c:
        assert len(completion_events(c, schema)) == 1
        assert invariant_violations(c, schema) == []


def test_the_stream_applies_failures_from_the_topic_and_dead_letters_bad_ones_as_written(
    spark, pg_dsn, schema, kafka_bootstrap, topics, tmp_path
):
    topic, dlq = topics("acks", partitions=2), topics("dlq")
    b = _batch(pg_dsn, schema, 3000)
    ids = [f"{b}:0:{i}" for i in range(3000)]
    with AckProducer(bootstrap_servers=kafka_bootstrap, topic=topic) as acks:
        acks.ack(ids[:1000])
        acks.flush()
        acks.fail(ids[900:1200], "timeout")  # 900-999 acked first: duplicates
        acks.flush()
        acks.fail(ids[1100:1300], "bad row")  # 1100-1199 failed first under timeout
        acks.flush()
        acks.ack(ids[1250:])  # 1250-1299 failed first
        acks.fail([f"{b}:7:0"], "timeout")  # unknown group
    query, totals = tspark.ack_stream(
        spark,
        bootstrap_servers=kafka_bootstrap,
        topic=topic,
        dsn=pg_dsn,
        schema=schema,
        checkpoint_location=str(tmp_path / "cp"),
        dead_letter_topic=dlq,
        trigger_interval="200 milliseconds",
    )
    try:
        wait_for(
            lambda: totals.completed_count == 1 and totals.rejected_count, timeout=180, what="the stream to complete"
        )
    finally:
        query.stop()
    assert (totals.acked, totals.failed) == (1000 + 1700, 300)
    (counts, failed) = _decided(pg_dsn, schema, b)
    assert counts == (2700, 300, 0)
    with psycopg.connect(pg_dsn) as c:
        items, after = [], None
        while True:
            page = tracker.failures(c, b, after=after, limit=1000, schema=schema)
            items += page.items
            if page.next is None:
                break
            after = page.next
    assert items == [(i, "timeout") for i in ids[1000:1200]] + [(i, "bad row") for i in ids[1200:1300]]
    [letter] = read_messages(kafka_bootstrap, dlq, 1)
    headers = dict(letter.headers())
    assert letter.value() == f"!{b}:7:0".encode()
    assert (headers["reason"], headers["failure-reason"]) == (b"unknown group", b"timeout")
    with psycopg.connect(pg_dsn) as c:
        assert len(completion_events(c, schema)) == 1
        assert invariant_violations(c, schema) == []
