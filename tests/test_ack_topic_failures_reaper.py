"""Failures through the ack topic, end to end: AckProducer and hand-written messages through the real
Kafka to a real `reaper run` (its acker) and Postgres, read back with tracker.failures() and the
batches' completion events."""

from __future__ import annotations

import json
import uuid

import psycopg
from confluent_kafka import Producer
from support.acking import batch_state, closed_batch, committed, end_offsets
from support.harness import read_messages, wait_for
from test_tracker_support import completion_events, invariant_violations

import tracker
from tracker.consumer import AckProducer
from tracker.folding import FAILURE_REASON_HEADER


def all_failures(conn, schema, batch_id) -> list[tuple[str, str]]:
    out, after = [], None
    while True:
        page = tracker.failures(conn, batch_id, after=after, limit=7, schema=schema)
        out.extend(page.items)
        if page.next is None:
            return out
        after = page.next


def event_of(conn, schema, batch_id) -> dict:
    (value,) = [json.loads(v) for k, v in completion_events(conn, schema) if k == str(batch_id).encode()]
    return value


def test_failures_and_acks_through_the_ack_topic_finish_batches_as_the_calls_would(
    pg_dsn, schema, kafka_bootstrap, topics, tmp_path
):
    from support.reaper import ReaperProcess

    topic, dlq = topics("acks", partitions=2), topics("dlq")
    group = f"acker-{uuid.uuid4().hex[:8]}"
    env = {
        "REAPER_DATABASE__DSN": pg_dsn,
        "REAPER_DATABASE__SCHEMA": schema,
        "REAPER_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap,
        "REAPER_HARVESTER__ENABLED": "false",  # completion events stay in the outbox, to be read
        "REAPER_ACKER__ENABLED": "true",
        "REAPER_ACKER__TOPIC": topic,
        "REAPER_ACKER__GROUP": group,
        "REAPER_ACKER__DEAD_LETTER_TOPIC": dlq,
    }
    # A: 300 items (groups of 8192: one group), acks, failures of two reasons, duplicates of both.
    a, (ha,) = closed_batch(pg_dsn, schema, 300)
    # B: the first outcome of each item wins inside one poll, whichever outcome it is.
    b, (hb,) = closed_batch(pg_dsn, schema, 10)
    # C: fail fast (tolerated_failures=0): the failure finishes it; acks after it are late.
    with psycopg.connect(pg_dsn) as conn:
        c = tracker.open_batch(conn, tolerated_failures=0, schema=schema)
        (hc,) = tracker.add_items(conn, c, 5, schema=schema)
        tracker.close_batch(conn, c, schema=schema)
        conn.commit()
    A, B, C = (f"{x.id}:{h.group_id}" for x, h in ((a, ha), (b, hb), (c, hc)))
    timeout, bad_row = "upstream timed out, after 3 tries", "bad row: prix ≠ price"

    # Everything is in the topic before the reaper starts: its first polls see it all at once.
    acks = AckProducer(bootstrap_servers=kafka_bootstrap, topic=topic)
    acks.ack([f"{A}:{i}" for i in range(0, 200)])
    acks.flush()
    acks.fail([f"{A}:200-249"], timeout)
    acks.fail([f"{A}:250-299", f"{A}:0-9"], bad_row)  # 0-9 were acked: duplicates
    acks.flush()
    acks.ack([f"{A}:200-209", f"{A}:0-99"])  # after their failure or ack: duplicates
    acks.fail([f"{A}:250"], timeout)  # failed first under the other reason: a duplicate
    acks.flush()
    raw = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})

    def send(key, value, reason=None):
        headers = None if reason is None else [(FAILURE_REASON_HEADER, reason.encode())]
        raw.produce(topic, key=str(key).encode(), value=value.encode(), headers=headers)

    send(b.id, f"!{B}:0", "x")
    send(b.id, f"{B}:0-4")  # 0 failed first
    send(b.id, f"!{B}:3-9,{B}:9", "y")  # 3, 4 acked first; 9 failed in this very message
    send(b.id, f"!{B}:1")  # no reason: dead-lettered whole, nothing applied
    send(b.id, f"!{B}:2", "z" * 501)  # a reason tracker.fail refuses: likewise
    send(999_999_999, "!999999999:0:0", "ghost")  # an unknown batch: rejected, dead-lettered
    send(c.id, f"{C}:0")
    send(c.id, f"!{C}:1", "first failure")
    send(c.id, f"{C}:2-4")
    assert raw.flush(30) == 0

    reaper = ReaperProcess(env, tmp_path / "reaper.log")
    try:
        wait_for(
            lambda: all(batch_state(pg_dsn, schema, x.id)[0] == "complete" for x in (a, b, c)),
            what="the three batches to finish",
        )
        wait_for(
            lambda: committed(kafka_bootstrap, group, topic, 2) == end_offsets(kafka_bootstrap, topic, 2),
            what="the acker to commit every offset",
        )
        assert reaper.terminate(60) == 0
    finally:
        reaper.kill()

    with psycopg.connect(pg_dsn) as conn:
        fa = all_failures(conn, schema, a.id)
        assert fa == [(f"{A}:{i}", timeout) for i in range(200, 250)] + [(f"{A}:{i}", bad_row) for i in range(250, 300)]
        ea = event_of(conn, schema, a.id)
        assert (ea["schema_version"], ea["event"], ea["outcome"]) == (2, "batch.completed", "failed")
        assert (ea["total"], ea["succeeded"], ea["failed"], ea["pending"]) == (300, 200, 100, 0)
        assert ea["rollup"] == {"total": 300, "succeeded": 200, "failed": 100}

        assert all_failures(conn, schema, b.id) == [(f"{B}:0", "x")] + [(f"{B}:{i}", "y") for i in range(5, 10)]
        eb = event_of(conn, schema, b.id)
        assert (eb["outcome"], eb["succeeded"], eb["failed"], eb["pending"]) == ("failed", 4, 6, 0)

        # As the calls in that order would: ack 0, fail 1 (the threshold finishes it: 3 still
        # pending at that moment), then 2-4 acked late.
        assert all_failures(conn, schema, c.id) == [(f"{C}:1", "first failure")]
        ec = event_of(conn, schema, c.id)
        assert (ec["outcome"], ec["succeeded"], ec["failed"], ec["pending"]) == ("failed", 1, 1, 3)
        sc = tracker.status(conn, c.id, schema=schema)
        assert (sc.succeeded, sc.failed, sc.late) == (4, 1, 3)
        assert len(completion_events(conn, schema)) == 3  # each batch finished once
        assert invariant_violations(conn, schema) == []

    letters = read_messages(kafka_bootstrap, dlq, 3)
    got = sorted(
        (m.value(), dict(m.headers())["reason"].decode().split(":")[0], dict(m.headers()).get(FAILURE_REASON_HEADER))
        for m in letters
    )
    assert got == sorted(
        [
            (f"!{B}:1".encode(), "invalid failure", None),
            (f"!{B}:2".encode(), "invalid failure", b"z" * 501),
            (b"!999999999:0:0", "unknown batch", b"ghost"),
        ]
    )
    stopped = next(e for e in reaper.events() if e.get("event") == "acker stopped")
    assert stopped["failed"] == 50 + 50 + 1 + 5 + 1 and stopped["acked"] == 200 + 4 + 1 + 3
    assert stopped["dead_lettered"] == 3
