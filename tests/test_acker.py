"""The acker against the real Postgres and Kafka: bulk apply, replays, dead letters, rebalances, lag."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import psycopg
from confluent_kafka import Consumer, Producer, TopicPartition
from prometheus_client import REGISTRY
from support.acking import batch_state, closed_batch, committed, end_offsets, make_acker, produce_raw, running
from support.harness import read_messages, wait_for
from test_tracker_support import completion_events, invariant_violations

import tracker
from harvester.services.acker import Acker
from tracker.consumer import AckProducer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_acker_applies_ids_and_runs_once_and_commits_offsets(pg_dsn, schema, kafka_bootstrap, topics):
    topic, dlq = topics("acks", partitions=2), topics("dlq")
    b1, h1 = closed_batch(pg_dsn, schema, 20_000)  # groups of 8192, 8192, 3616
    b2, h2 = closed_batch(pg_dsn, schema, 10)
    with AckProducer(bootstrap_servers=kafka_bootstrap, topic=topic) as acks:
        for h in h1:
            acks.ack(h.item_ids)
            acks.ack(h.item_ids[:100])  # duplicates inside the stream
    # single ids, one per message, some twice
    produce_raw(
        kafka_bootstrap, topic, [(str(b2.id).encode(), i.encode()) for i in h2[0].item_ids + h2[0].item_ids[:3]]
    )
    acker = make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq)
    with running(acker):
        wait_for(
            lambda: (
                batch_state(pg_dsn, schema, b1.id)[0] == "complete"
                and batch_state(pg_dsn, schema, b2.id)[0] == "complete"
            ),
            what="both batches complete",
        )
        wait_for(
            lambda: committed(kafka_bootstrap, acker.group, topic, 2) == end_offsets(kafka_bootstrap, topic, 2),
            what="offsets committed to the end",
        )
    assert acker.stats["acked"] == 20_010 and acker.stats["completed"] == 2 and acker.stats["dead_lettered"] == 0
    assert acker.stats["duplicates"] >= 3
    with psycopg.connect(pg_dsn) as c:
        assert sorted(k for k, _ in completion_events(c, schema)) == sorted([str(b1.id).encode(), str(b2.id).encode()])
        assert invariant_violations(c, schema) == []


CRASHING_ACKER = textwrap.dedent("""
    import os, sys, threading
    from harvester.services.acker import Acker

    class CrashAfterDbCommit(Acker):
        def _commit(self, consumer):
            if self.offsets.uncommitted:  # the database has this poll; Kafka never learns it
                os._exit(17)

    dsn, schema, bootstrap, topic, dlq, group = sys.argv[1:7]
    # The broker's shortest session: the replaying acker joins once the crashed member has expired.
    CrashAfterDbCommit(dsn=dsn, schema=schema, bootstrap_servers=bootstrap, topic=topic, group=group,
                       dead_letter_topic=dlq, max_poll_records=1_000_000, poll_timeout=0.5,
                       consumer_client={"session.timeout.ms": 6000}).run(threading.Event())
""")


def _rows(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as c:
        return {
            "batch": c.execute(
                f'SELECT id, state, total, pending, completed_at FROM "{schema}".batch ORDER BY id'
            ).fetchall(),
            "groups": c.execute(f'SELECT * FROM "{schema}".batch_group ORDER BY batch_id, id').fetchall(),
            "outbox": c.execute(f'SELECT * FROM "{schema}".outbox ORDER BY id').fetchall(),
        }


def test_replay_after_crash_between_db_commit_and_offset_commit_changes_nothing(
    pg_dsn, schema, kafka_bootstrap, topics
):
    topic, dlq = topics("acks"), topics("dlq")
    done, done_h = closed_batch(pg_dsn, schema, 300)
    part, part_h = closed_batch(pg_dsn, schema, 300)
    with AckProducer(bootstrap_servers=kafka_bootstrap, topic=topic) as acks:
        acks.ack(done_h[0].item_ids)
        acks.ack(part_h[0].item_ids[:150])
    group = f"acker-{uuid.uuid4().hex[:8]}"
    crash = subprocess.run(
        [sys.executable, "-c", CRASHING_ACKER, pg_dsn, schema, kafka_bootstrap, topic, dlq, group],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert crash.returncode == 17, crash.stderr[-2000:]
    after_crash = _rows(pg_dsn, schema)
    assert [r[1:4] for r in after_crash["batch"]] == [("complete", 300, 0), ("closed", 300, 150)]
    assert committed(kafka_bootstrap, group, topic, 1) == [0]  # no offset was ever committed

    acker = make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq, group=group)
    with running(acker):
        wait_for(
            lambda: committed(kafka_bootstrap, group, topic, 1) == end_offsets(kafka_bootstrap, topic, 1),
            what="the replay to commit its offsets",
        )
    assert (acker.stats["acked"], acker.stats["duplicates"], acker.stats["completed"]) == (0, 450, 0)
    assert _rows(pg_dsn, schema) == after_crash  # the replay changed nothing, completed nothing twice
    with psycopg.connect(pg_dsn) as c:
        assert len(completion_events(c, schema)) == 1
        assert invariant_violations(c, schema) == []


def test_bad_acks_reach_the_dead_letter_topic_and_the_partition_keeps_moving(pg_dsn, schema, kafka_bootstrap, topics):
    topic, dlq = topics("acks"), topics("dlq")
    b, (h,) = closed_batch(pg_dsn, schema, 10)
    gone, _ = closed_batch(pg_dsn, schema, 5)
    with psycopg.connect(pg_dsn) as c:  # as the sweeper leaves it
        c.execute(f"UPDATE \"{schema}\".batch SET state = 'expired', expired_at = now() WHERE id = %s", [gone.id])
    k = str(b.id).encode()
    bad = [
        b"\xff\xfe",
        b"",
        None,
        b"hello",
        b"1:2",
        f"{b.id}:0:5-3".encode(),
        b"999999999:0:1",
        f"{b.id}:77:0".encode(),
        f"{b.id}:0:12".encode(),
        f"{b.id}:0:99999999999".encode(),
        f"{gone.id}:0:1".encode(),
        b"9223372036854775808:0:0",
    ]
    good = [f"{b.id}:0:{i}".encode() for i in range(10)]
    # bad acks before, between and after the good ones, in one partition; one message mixes both
    stream = bad[:5] + good[:5] + bad[5:] + [f"{b.id}:0:5,{b.id}:0:x".encode()] + good[6:]
    produce_raw(kafka_bootstrap, topic, [(k, v) for v in stream])
    before = REGISTRY.get_sample_value("reaper_acks_dead_lettered_total", {"schema": schema}) or 0.0
    acker = make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq, max_poll_records=4)  # many polls
    with running(acker):
        wait_for(
            lambda: batch_state(pg_dsn, schema, b.id) == ("complete", 0), what="the good acks to complete the batch"
        )
        wait_for(lambda: committed(kafka_bootstrap, acker.group, topic, 1) == [len(stream)], what="offsets at the end")
    letters = read_messages(kafka_bootstrap, dlq, len(bad) + 1)
    got = {m.value(): dict(m.headers())["reason"].decode() for m in letters}
    assert len(letters) == len(bad) + 1 == acker.stats["dead_lettered"]
    assert REGISTRY.get_sample_value("reaper_acks_dead_lettered_total", {"schema": schema}) - before == len(bad) + 1
    assert got[b"\xff\xfe"].startswith("malformed") and got[None].startswith("malformed")
    assert got[b""].startswith("malformed") and got[b"hello"].startswith("malformed")
    assert got[f"{b.id}:0:5-3".encode()].startswith("malformed") and got[f"{b.id}:0:x".encode()].startswith("malformed")
    assert got[b"999999999:0:1"] == "unknown batch"
    assert got[f"{b.id}:77:0".encode()] == "unknown group"
    assert got[f"{b.id}:0:12".encode()] == "index out of range (group size 10)"
    assert got[f"{b.id}:0:99999999999".encode()].startswith("index out of range")
    assert got[f"{gone.id}:0:1".encode()] == "batch expired"
    assert got[b"9223372036854775808:0:0"].startswith("malformed")  # past a bigint: not a stuck partition
    with psycopg.connect(pg_dsn) as c:
        assert len(completion_events(c, schema)) == 1
        assert invariant_violations(c, schema) == []


def test_rebalance_between_two_ackers_loses_and_duplicates_no_completion(pg_dsn, schema, kafka_bootstrap, topics):
    topic, dlq = topics("acks", partitions=4), topics("dlq")
    group = f"acker-{uuid.uuid4().hex[:8]}"
    batches = [closed_batch(pg_dsn, schema, 500) for _ in range(24)]
    first = make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq, group=group, max_poll_records=50)
    second = make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq, group=group, max_poll_records=50)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})

    def send(selection):
        for b, (h,) in selection:
            for i in h.item_ids:
                producer.produce(topic, key=str(b.id).encode(), value=i.encode())
        assert producer.flush(30) == 0

    with running(first) as stop_first:
        send(batches[:8])
        with running(second):
            send(batches[8:16])  # while the group rebalances onto two members
            stop_first.set()  # the first leaves: its partitions move to the second
            send(batches[16:])
            wait_for(
                lambda: all(batch_state(pg_dsn, schema, b.id)[0] == "complete" for b, _ in batches),
                timeout=120,
                what="all batches complete",
            )
    assert first.stats["acked"] + second.stats["acked"] == 24 * 500
    with psycopg.connect(pg_dsn) as c:
        assert len(completion_events(c, schema)) == 24
        assert invariant_violations(c, schema) == []


def test_lag_is_reported_from_the_position(pg_dsn, schema, kafka_bootstrap, topics):
    topic, dlq = topics("acks"), topics("dlq")
    b, (h,) = closed_batch(pg_dsn, schema, 1000)
    produce_raw(kafka_bootstrap, topic, [(b"x", i.encode()) for i in h.item_ids])
    seen = []

    class Recording(Acker):
        def _handle(self, consumer, producer, messages):
            ok = super()._handle(consumer, producer, messages)
            seen.append(self.lag(consumer))
            return ok

    acker = Recording(
        dsn=pg_dsn,
        schema=schema,
        bootstrap_servers=kafka_bootstrap,
        topic=topic,
        group=f"acker-{uuid.uuid4().hex[:8]}",
        dead_letter_topic=dlq,
        max_poll_records=100,
        poll_timeout=0.1,
        lag_interval=0.0,
    )
    with running(acker):
        wait_for(lambda: batch_state(pg_dsn, schema, b.id)[0] == "complete", what="batch complete")
        wait_for(
            lambda: REGISTRY.get_sample_value("reaper_acker_lag_messages", {"schema": schema}) == 0, what="gauge at 0"
        )
    assert 900 <= seen[0] < 1000 and seen[-1] == 0
    assert seen == sorted(seen, reverse=True)


def test_database_failure_rewinds_and_retries_without_losing_acks(pg_dsn, schema, kafka_bootstrap, topics):
    topic, dlq = topics("acks"), topics("dlq")
    b, (h,) = closed_batch(pg_dsn, schema, 400)
    produce_raw(kafka_bootstrap, topic, [(b"k", i.encode()) for i in h.item_ids])
    hidden = schema + "_away"
    with psycopg.connect(pg_dsn, autocommit=True) as c:  # the acker's tables vanish: every apply fails
        c.execute(f'ALTER SCHEMA "{schema}" RENAME TO "{hidden}"')
    acker = make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq, max_poll_records=150, retry_backoff=0.2)
    try:
        with running(acker):
            wait_for(lambda: acker.stats["retries"] >= 3, what="failed applies")
            assert committed(kafka_bootstrap, acker.group, topic, 1) == [0]  # nothing committed past a failure
            with psycopg.connect(pg_dsn, autocommit=True) as c:
                c.execute(f'ALTER SCHEMA "{hidden}" RENAME TO "{schema}"')
            wait_for(lambda: batch_state(pg_dsn, schema, b.id) == ("complete", 0), what="the batch after recovery")
            wait_for(lambda: committed(kafka_bootstrap, acker.group, topic, 1) == [400], what="offsets at the end")
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            if c.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", [hidden]).fetchone():
                c.execute(f'ALTER SCHEMA "{hidden}" RENAME TO "{schema}"')
    assert acker.stats["acked"] == 400 and acker.stats["dead_lettered"] == 0
    with psycopg.connect(pg_dsn) as c:
        assert len(completion_events(c, schema)) == 1
        assert invariant_violations(c, schema) == []


def test_two_reaper_processes_share_the_ack_topic_and_survive_one_stopping(
    pg_dsn, schema, kafka_bootstrap, topics, tmp_path
):
    from support.reaper import ReaperProcess

    topic, dlq = topics("acks", partitions=4), topics("dlq")
    group = f"acker-{uuid.uuid4().hex[:8]}"
    env = {
        "REAPER_DATABASE__DSN": pg_dsn,
        "REAPER_DATABASE__SCHEMA": schema,
        "REAPER_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap,
        "REAPER_HARVESTER__ENABLED": "false",
        "REAPER_ACKER__ENABLED": "true",
        "REAPER_ACKER__TOPIC": topic,
        "REAPER_ACKER__GROUP": group,
        "REAPER_ACKER__DEAD_LETTER_TOPIC": dlq,
        "REAPER_ACKER__MAX_POLL_RECORDS": "200",
    }
    batches = [closed_batch(pg_dsn, schema, 1000) for _ in range(12)]
    producer = Producer({"bootstrap.servers": kafka_bootstrap})

    def send(selection):
        for k, (b, (h,)) in enumerate(selection):
            for i in h.item_ids:  # every partition gets a batch, so both reapers have work
                producer.produce(topic, key=str(b.id).encode(), value=i.encode(), partition=k % 4)
        assert producer.flush(30) == 0

    reapers = [ReaperProcess(env, tmp_path / f"reaper{k}.log") for k in range(2)]

    def owns_partitions(r):
        return any(e.get("event") == "ack partitions assigned" and e.get("partitions") for e in r.events())

    try:
        wait_for(lambda: all(owns_partitions(r) for r in reapers), what="both reapers to own ack partitions")
        send(batches[:6])
        wait_for(
            lambda: all(batch_state(pg_dsn, schema, b.id)[0] == "complete" for b, _ in batches[:6]),
            what="the first batches through both reapers",
        )
        assert reapers[0].terminate(60) == 0  # SIGTERM: its partitions move to the other reaper
        send(batches[6:])
        wait_for(
            lambda: all(batch_state(pg_dsn, schema, b.id)[0] == "complete" for b, _ in batches),
            timeout=120,
            what="every batch complete through the remaining reaper",
        )
        assert reapers[1].terminate(60) == 0
    finally:
        for r in reapers:
            r.kill()
    assert committed(kafka_bootstrap, group, topic, 4) == end_offsets(kafka_bootstrap, topic, 4)
    stopped = [next(e for e in r.events() if e.get("event") == "acker stopped") for r in reapers]
    assert all(s["acked"] > 0 for s in stopped) and sum(s["acked"] for s in stopped) == 12_000
    with psycopg.connect(pg_dsn) as c:
        assert len(completion_events(c, schema)) == 12
        assert invariant_violations(c, schema) == []


def test_reaper_acker_writes_completions_to_the_configured_topic_and_table(
    pg_dsn, schema, kafka_bootstrap, topics, tmp_path
):
    """`reaper run` hands its schema, outbox table and default completion topic to the tracker code it hosts."""
    from support.reaper import ReaperProcess

    topic, dlq = topics("acks"), topics("dlq")
    env = {
        "REAPER_DATABASE__DSN": pg_dsn,
        "REAPER_DATABASE__SCHEMA": schema,
        "REAPER_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap,
        "REAPER_HARVESTER__ENABLED": "false",
        "REAPER_HARVESTER__DEFAULT_COMPLETION_TOPIC": "catalog-done",
        "REAPER_ACKER__ENABLED": "true",
        "REAPER_ACKER__TOPIC": topic,
        "REAPER_ACKER__GROUP": f"acker-{uuid.uuid4().hex[:8]}",
        "REAPER_ACKER__DEAD_LETTER_TOPIC": dlq,
    }
    batch, (handle,) = closed_batch(pg_dsn, schema, 10)
    reaper = ReaperProcess(env, tmp_path / "reaper.log")
    try:
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        producer.produce(topic, key=str(batch.id).encode(), value=f"{batch.id}:{handle.group_id}:0-9".encode())
        assert producer.flush(30) == 0
        wait_for(lambda: batch_state(pg_dsn, schema, batch.id)[0] == "complete", what="the batch to complete")
        assert reaper.terminate(60) == 0
    finally:
        reaper.kill()
    with psycopg.connect(pg_dsn) as c:
        assert completion_events(c, schema, "batch-completions") == []
        ((key, value),) = completion_events(c, schema, "catalog-done")
    assert key == str(batch.id).encode() and json.loads(value)["batch_id"] == batch.id


def test_the_ackers_kafka_clients_reconnect_within_a_second_unless_configured_otherwise(kafka_bootstrap):
    """librdkafka's default back-off grows to 10 s between attempts: an acker would sit idle that long
    after a broker came back. The configured client settings still win."""
    acker = make_acker("postgresql://unused", "s", kafka_bootstrap, "acks-unused", "dlq-unused")
    for conf in (acker._consumer_conf, acker._producer_conf):
        assert (conf["reconnect.backoff.ms"], conf["reconnect.backoff.max.ms"]) == (50, 1000)
    tuned = make_acker(
        "postgresql://unused",
        "s",
        kafka_bootstrap,
        "acks-unused",
        "dlq-unused",
        kafka_client={"reconnect.backoff.max.ms": 5000},
    )
    assert tuned._consumer_conf["reconnect.backoff.max.ms"] == tuned._producer_conf["reconnect.backoff.max.ms"] == 5000
