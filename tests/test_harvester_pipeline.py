"""Mark-purge/reset against the real Postgres and Kafka, with injected faults (goharvest's pipeline cases)."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid

import psycopg
import pytest
from support.faults import FaultPlan
from support.harness import (
    Generator,
    Receiver,
    insert_rows,
    make_config,
    order_violations,
    outbox_count,
    running,
    wait_until,
)

from harvester.metrics import get as get_metrics
from harvester.publishing.outbox_sql import FOREVER, OutboxStore, make_pool
from harvester.units import Harvester
from tracker import message_ids
from tracker.message_ids import MESSAGE_ID_HEADER

PARTITIONS = 4


@pytest.fixture
def setup(pg_dsn, kafka_bootstrap, schema, topics):
    topic = topics("data", partitions=PARTITIONS)
    leader = topics("leader", partitions=1)

    def make(**harvester):
        return make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=leader, harvester=harvester)

    receiver = Receiver(kafka_bootstrap, topic, PARTITIONS)
    yield make, topic, receiver
    receiver.close()


def _publish_all_in_order(pg_dsn, schema, topic, receiver, cfg, faults=None, keys=30, txns=100, per_txn=20, timeout=90):
    gen = Generator(pg_dsn, schema, topic, keys=keys, per_txn=per_txn)
    with psycopg.connect(pg_dsn) as conn:
        for _ in range(txns // 2):
            gen.commit_once(conn)
        with running(cfg, faults) as h:
            for _ in range(txns - txns // 2):  # some committed while the harvester runs
                gen.commit_once(conn)
            assert receiver.wait_for(gen.committed, timeout), (
                f"missing {len(gen.committed - receiver.unique())} of {len(gen.committed)}"
            )
            assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0, 30), "published rows were not all purged"
    records = [(k, v) for k, v, _ in receiver.records]
    assert order_violations(records) == []
    assert receiver.unique() == gen.committed
    return h


def _counter(name: str) -> float:
    return getattr(get_metrics(), name)._value.get()


def test_publishes_headers_null_keys_and_values_and_explicit_partitions(setup, pg_dsn, schema, conn):
    make, topic, receiver = setup
    with conn.cursor() as cur:
        cur.execute(
            f'INSERT INTO "{schema}".outbox (topic, key, value, header_keys, header_values, kafka_partition) '
            "VALUES (%s, %s, %s, %s, %s, %s), (%s, NULL, %s, '{}', '{}', NULL), (%s, %s, NULL, '{}', '{}', 3)",
            [
                topic,
                b"k1",
                b"v1",
                ["item-id", "bin"],
                [b"1:0:0", bytes(range(256))],
                2,
                topic,
                b"no key",
                topic,
                b"tomb",
            ],
        )
    ns = message_ids.namespace(conn, schema)
    rows = conn.execute(f'SELECT id, created_at FROM "{schema}".outbox ORDER BY id').fetchall()
    conn.commit()
    # the harvester's, after the row's own
    mid = [(MESSAGE_ID_HEADER, message_ids.message_id(ns, i, at).encode()) for i, at in rows]
    with running(make()):
        assert wait_until(lambda: len(receiver.records) >= 3, 30)
        assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0, 30)
    got = sorted(receiver.records, key=lambda r: (r[0] or b"", r[1] or b""))
    assert got == sorted(
        [
            (b"k1", b"v1", [("item-id", b"1:0:0"), ("bin", bytes(range(256))), mid[0]]),
            (None, b"no key", [mid[1]]),
            (b"tomb", None, [mid[2]]),
        ],
        key=lambda r: (r[0] or b"", r[1] or b""),
    )


@contextlib.contextmanager
def peak_in_flight(h: Harvester):
    """Sample the publisher's records in flight while the block runs; yields [peak]."""
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if h.publisher is not None:
                peak[0] = max(peak[0], h.publisher.in_flight)
            time.sleep(0.0002)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        yield peak
    finally:
        stop.set()
        t.join()


def test_hot_key_keeps_order_with_many_records_in_flight(setup, pg_dsn, schema):
    """No one-in-flight-per-key barrier: one key has hundreds of records in flight, in order."""
    make, topic, receiver = setup
    with psycopg.connect(pg_dsn) as conn:
        insert_rows(conn, schema, topic, [(b"hot", b"hot:%d" % i) for i in range(20000)])
    with running(make(mark_batch=2000, max_in_flight=4000)) as h, peak_in_flight(h) as peak:
        assert receiver.wait_for({(b"hot", b"hot:%d" % i) for i in range(20000)}, 60)
    assert order_violations([(k, v) for k, v, _ in receiver.records]) == []
    assert peak[0] > 100, f"one key never had more than {peak[0]} records in flight"


def test_throttle_bounds_records_in_flight(setup, pg_dsn, schema):
    make, topic, receiver = setup
    with psycopg.connect(pg_dsn) as conn:
        insert_rows(conn, schema, topic, [(b"k%d" % (i % 7), b"k%d:%d" % (i % 7, i)) for i in range(3000)])
    with running(make(mark_batch=50, max_in_flight=100)) as h, peak_in_flight(h) as peak:
        assert receiver.wait_for({(b"k%d" % (i % 7), b"k%d:%d" % (i % 7, i)) for i in range(3000)}, 60)
    assert 0 < peak[0] <= 100


def test_mark_deadline_exceeded_forces_remark_and_loses_nothing(setup, pg_dsn, schema):
    make, topic, receiver = setup
    before = _counter("force_remarks")
    faults = FaultPlan(mark_delay=0.3, mark_delay_rate=0.3, seed=1)
    _publish_all_in_order(pg_dsn, schema, topic, receiver, make(mark_deadline=0.2, mark_batch=200), faults, txns=40)
    assert _counter("force_remarks") > before


def test_local_queue_limit_exceeded_forces_remark_and_keeps_order(setup, pg_dsn, schema, kafka_bootstrap):
    """A real librdkafka queue limit: produce() raises BufferError part-way through a mark."""
    make, topic, receiver = setup
    cfg = make(mark_batch=500, max_in_flight=2000)
    cfg.kafka.producer = {"queue.buffering.max.messages": 100, "linger.ms": 20}
    h = _publish_all_in_order(pg_dsn, schema, topic, receiver, cfg, txns=100)
    assert h.publisher.queue_full_waits > 0  # the queue did fill up: produce waited and retried in order


def test_injected_queue_full_and_produce_errors(setup, pg_dsn, schema):
    make, topic, receiver = setup
    before = _counter("produce_errors")
    faults = FaultPlan(queue_full_rate=0.3, produce_error_rate=0.002, seed=2)
    h = _publish_all_in_order(pg_dsn, schema, topic, receiver, make(mark_batch=300), faults)
    assert h.publisher.queue_full_waits > 0
    # Each refusal is counted; the record is produced again in place (no remark needed: the
    # refusal that persists and stops the call is tested in test_harvester_runs).
    assert _counter("produce_errors") > before


def test_failed_delivery_resets_and_remarks(setup, pg_dsn, schema):
    """Ambiguous failures (written, reported failed) and fatal ones (producer replaced)."""
    make, topic, receiver = setup
    before = _counter("records_reset" if False else "reset"), _counter("force_remarks")
    faults = FaultPlan(delivery_error_rate=0.01, delivery_fatal_rate=0.002, seed=3)
    _publish_all_in_order(pg_dsn, schema, topic, receiver, make(mark_batch=300), faults)
    assert _counter("reset") > before[0]
    assert _counter("force_remarks") > before[1]


@pytest.mark.parametrize("which", ["mark_error_rate", "purge_error_rate", "reset_error_rate"])
def test_database_errors_in_mark_purge_and_reset(setup, pg_dsn, schema, which):
    make, topic, receiver = setup
    before = _counter("force_remarks")
    rates = {which: 0.1}
    if which == "reset_error_rate":
        # resets only happen after failed deliveries; injected per delivery report, and without
        # transactions one report stands for a produce call's records of a partition
        rates["delivery_error_rate"] = 0.3
    faults = FaultPlan(seed=4, **rates)
    _publish_all_in_order(pg_dsn, schema, topic, receiver, make(mark_batch=200, purge_batch=100), faults, txns=60)
    assert _counter("force_remarks") > before


def test_purge_and_reset_hitting_no_row(pg_dsn, schema, conn):
    with conn.cursor() as cur:
        cur.execute(
            f'INSERT INTO "{schema}".outbox (topic, value) SELECT %s, %s FROM generate_series(1, 5)', ["t", b"v"]
        )
    conn.commit()
    pool = make_pool(pg_dsn, 2)
    try:
        store = OutboxStore(pool, schema)
        me, other = uuid.uuid4(), uuid.uuid4()
        rows = store.mark(me, 3, until=FOREVER)
        assert [r[0] for r in rows] == sorted(r[0] for r in rows) and len(rows) == 3
        ids = [r[0] for r in rows]
        assert store.purge(other, ids) == 0  # marked by someone else now: purge touches nothing
        assert store.reset(other, ids) == 0
        assert store.purge(me, ids[:1]) == 1
        assert store.purge(me, ids[:1]) == 0  # already gone
        assert store.reset(me, ids[:1]) == 0
        assert store.reset(me, ids[1:]) == 2
        assert store.purge(me, ids[1:]) == 0  # reset: no longer ours
        assert [r[0] for r in store.mark(me, 10, until=FOREVER)] == [
            *ids[1:],
            *[i for i in range(ids[-1] + 1, ids[-1] + 3)],
        ]
    finally:
        pool.close()


def test_backlog_counts_exactly_up_to_the_limit_then_takes_the_estimate(pg_dsn, schema, conn):
    conn.execute(
        f'INSERT INTO "{schema}".outbox (topic, value) SELECT %s, %s FROM generate_series(1, 500)', ["t", b"v"]
    )
    conn.commit()
    pool = make_pool(pg_dsn, 1)
    try:
        store = OutboxStore(pool, schema)
        exact = store.backlog(exact_up_to=500)
        assert (exact.rows, exact.exact) == (500, True)
        over = store.backlog(exact_up_to=100)
        assert (over.rows, over.exact) == (500, False)  # the id span, no scan past the limit
        assert over.oldest_age >= 0
        with pool.connection() as c:  # rows gone from the middle: the span is an upper bound
            c.execute(
                f'DELETE FROM "{schema}".outbox WHERE id % 2 = 0 AND id <> (SELECT max(id) FROM "{schema}".outbox)'
            )
            left = c.execute(f'SELECT count(*) FROM "{schema}".outbox').fetchone()[0]
        assert left < 300 and store.backlog(exact_up_to=100).rows == 500
        assert (store.backlog(exact_up_to=300).rows, store.backlog(exact_up_to=300).exact) == (left, True)
    finally:
        pool.close()


def test_rows_committed_late_behind_published_ids_are_found(setup, pg_dsn, schema):
    make, topic, receiver = setup
    late = psycopg.connect(pg_dsn)
    try:
        insert_rows_nocommit = late.execute(
            f'INSERT INTO "{schema}".outbox (topic, key, value) VALUES (%s, %s, %s) RETURNING id',
            [topic, b"late", b"late:0"],
        ).fetchone()[0]
        with psycopg.connect(pg_dsn) as conn:
            insert_rows(conn, schema, topic, [(b"early", b"early:%d" % i) for i in range(50)])
        with running(make()):
            assert receiver.wait_for({(b"early", b"early:%d" % i) for i in range(50)}, 30)
            late.commit()  # a lower id than everything published so far
            assert receiver.wait_for({(b"late", b"late:0")}, 30)
        assert insert_rows_nocommit < 1e18
    finally:
        late.close()


def test_mark_waits_for_a_locked_row_instead_of_skipping_it(setup, pg_dsn, schema):
    """SKIP LOCKED would publish k:1.. before a locked k:0; the mark waits for the lock instead."""
    make, topic, receiver = setup
    with psycopg.connect(pg_dsn) as conn:
        insert_rows(conn, schema, topic, [(b"k", b"k:%d" % i) for i in range(10)])
    locker = psycopg.connect(pg_dsn)
    try:
        locker.execute(f'SELECT id FROM "{schema}".outbox ORDER BY id LIMIT 1 FOR UPDATE')
        with running(make()):
            time.sleep(1.5)
            assert receiver.records == []  # nothing may overtake the locked head row
            locker.rollback()
            assert receiver.wait_for({(b"k", b"k:%d" % i) for i in range(10)}, 30)
        assert order_violations([(k, v) for k, v, _ in receiver.records]) == []
    finally:
        locker.close()


def test_rows_without_header_arrays_survive_a_full_local_queue(setup, pg_dsn, schema):
    """An application's table may leave header_keys/header_values NULL: the record produced again
    after a full librdkafka queue carries the message id alone, as its first try did."""
    make, topic, receiver = setup
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            f'ALTER TABLE "{schema}".outbox DROP CONSTRAINT outbox_headers_paired, '
            "ALTER COLUMN header_keys DROP NOT NULL, ALTER COLUMN header_values DROP NOT NULL"
        )
        conn.execute(
            f'INSERT INTO "{schema}".outbox (topic, key, value, header_keys, header_values) '
            "SELECT %s, ('k' || i %% 7)::bytea, ('v' || i)::bytea, NULL, NULL FROM generate_series(1, 3000) i",
            [topic],
        )
    cfg = make(mark_batch=500, max_in_flight=2000)
    cfg.kafka.producer = {"queue.buffering.max.messages": 100, "linger.ms": 20}
    with running(cfg) as h:
        expected = {(b"k%d" % (i % 7), b"v%d" % i) for i in range(1, 3001)}
        assert receiver.wait_for(expected, 60), "rows with NULL header arrays went missing"
        assert h.error is None and h.publisher.queue_full_waits > 0
    assert all([k for k, _ in headers] == [MESSAGE_ID_HEADER] for _, _, headers in receiver.records)
