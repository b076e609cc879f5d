"""Review findings on the harvester, each reproduced against the real Postgres and Kafka.

1. A row committed late below the marking position is found before a causally later row of its key.
2. A row Kafka will never accept is quarantined in outbox_dead; rows behind it keep flowing.
3. Fence or revocation retires the producer: queued and in-flight records are purged, a new
   producer takes over, the purged rows are reset (not purged) under the old leader id.
"""

from __future__ import annotations

import contextlib

import psycopg
from support.faults import FaultPlan, HeldHeartbeats
from support.harness import Receiver, insert_rows, make_config, order_violations, outbox_count, running, wait_until
from support.tcp_proxy import KafkaProxy

from harvester.metrics import get as get_metrics
from harvester.units import Harvester


def _counter(name: str) -> float:
    return getattr(get_metrics(), name)._value.get()


def _values_of(receiver: Receiver, key: bytes) -> list[bytes]:
    with receiver._lock:
        return [v for k, v, _ in receiver.records if k == key]


def test_row_committed_late_below_the_marking_position_precedes_a_later_row_of_its_key(
    pg_dsn, kafka_bootstrap, schema, topics
):
    """Txn A inserts K "created" (lowest id) and commits while the leader works through a backlog
    above it; txn B then inserts K "paid" (causally after A). "created" must come first.

    A cursor that skips ahead while batches come back full (the old `after`) marks "paid" on its
    way up and finds "created" only at the next head scan: "paid" would be published first.
    """
    topic = topics("data", partitions=1)
    leader = topics("leader", partitions=1)
    # Small marks over a 30k backlog: an implementation with a cursor would come back to the
    # head only after a short batch, i.e. only once the backlog is through.
    cfg = make_config(
        pg_dsn, schema, kafka_bootstrap, leader_topic=leader, harvester={"mark_batch": 50, "max_in_flight": 200}
    )
    receiver = Receiver(kafka_bootstrap, topic, 1)
    a = psycopg.connect(pg_dsn)  # application transaction A, slow to commit
    try:
        a.execute(f'INSERT INTO "{schema}".outbox (topic, key, value) VALUES (%s, %s, %s)', [topic, b"K", b"created"])
        with psycopg.connect(pg_dsn) as other:
            insert_rows(other, schema, topic, [(b"x%d" % (i % 50), b"x") for i in range(30000)])
            with running(cfg):
                # The leader is working its way up through the backlog: its position is above A's id.
                assert wait_until(lambda: len(receiver.records) >= 2000, 30)
                assert outbox_count(pg_dsn, schema) > 5000, "the backlog went too fast to test anything"
                a.commit()
                insert_rows(other, schema, topic, [(b"K", b"paid")])  # B: begins after A committed
                assert wait_until(lambda: set(_values_of(receiver, b"K")) >= {b"created", b"paid"}, 60)
                assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0, 60)
        got = _values_of(receiver, b"K")
        assert got.index(b"created") < got.index(b"paid"), f"key K published as {got}"
    finally:
        a.close()
        receiver.close()


def test_a_row_kafka_never_accepts_is_quarantined_and_the_rows_behind_it_flow(pg_dsn, kafka_bootstrap, schema, topics):
    topic = topics("data", partitions=2)
    leader = topics("leader", partitions=1)
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=leader)
    receiver = Receiver(kafka_bootstrap, topic, 2)
    dead_before, remarks_before = _counter("dead"), _counter("force_remarks")
    try:
        with psycopg.connect(pg_dsn) as c:
            big = c.execute(
                f'INSERT INTO "{schema}".outbox (topic, key, value) VALUES (%s, %s, %s) RETURNING id',
                [topic, b"K", b"x" * 2_000_000],
            ).fetchone()[0]
            for i in range(5):
                c.execute(
                    f'INSERT INTO "{schema}".outbox (topic, key, value) VALUES (%s, %s, %s)', [topic, b"K", b"K:%d" % i]
                )
            nopart = c.execute(
                f'INSERT INTO "{schema}".outbox (topic, key, value, kafka_partition) '
                "VALUES (%s, %s, %s, 7) RETURNING id",
                [topic, b"P", b"P:0"],
            ).fetchone()[0]
            c.execute(f'INSERT INTO "{schema}".outbox (topic, key, value) VALUES (%s, %s, %s)', [topic, b"P", b"P:1"])
            c.commit()
        with running(cfg) as h:
            assert wait_until(lambda: _values_of(receiver, b"K") == [b"K:%d" % i for i in range(5)], 30), _values_of(
                receiver, b"K"
            )
            assert wait_until(lambda: b"P:1" in _values_of(receiver, b"P"), 30)
            assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0, 30)
            # It keeps going: rows committed afterwards are published too.
            with psycopg.connect(pg_dsn) as c:
                insert_rows(c, schema, topic, [(b"K", b"K:5"), (b"K", b"K:6")])
            assert wait_until(lambda: _values_of(receiver, b"K")[-2:] == [b"K:5", b"K:6"], 30)
            assert h.publisher.dead_rows == 2
        with psycopg.connect(pg_dsn) as c:
            dead = c.execute(
                f"SELECT id, key, length(value), reason, failed_at IS NOT NULL, leader_id IS NOT NULL "
                f'FROM "{schema}".outbox_dead ORDER BY id'
            ).fetchall()
        assert [(d[0], bytes(d[1]), d[2]) for d in dead] == [(big, b"K", 2_000_000), (nopart, b"P", 3)]
        assert dead[0][3].startswith("MSG_SIZE_TOO_LARGE") and dead[1][3].startswith("_UNKNOWN_PARTITION"), dead
        assert all(d[4] and d[5] for d in dead)
        assert _values_of(receiver, b"P") == [b"P:1"]
        assert b"x" * 2_000_000 not in _values_of(receiver, b"K")
        assert _counter("dead") - dead_before == 2
        assert _counter("force_remarks") - remarks_before <= 2, "the bad rows kept forcing remarks"
    finally:
        receiver.close()


def test_repeated_remarks_without_progress_back_off(pg_dsn, kafka_bootstrap, schema, topics):
    """Every produce() fails (a refusal that is not permanent): remarks slow down instead of spinning."""
    topic = topics("data", partitions=1)
    leader = topics("leader", partitions=1)
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=leader)
    with psycopg.connect(pg_dsn) as c:
        insert_rows(c, schema, topic, [(b"k", b"k:%d" % i) for i in range(10)])
    with running(cfg, FaultPlan(produce_error_rate=1.0, seed=7), drain_timeout=2) as h:
        before = _counter("force_remarks")
        # 0.05 + 0.1 + 0.2 + ... doubling: the back-off reaches 1 s at about the sixth remark,
        # however slowly the machine runs them (without it: hundreds of remarks, no back-off)
        reached = wait_until(lambda: getattr(h, "remark_backoff", 0.0) >= 1.0, 30)
        remarks = _counter("force_remarks") - before
        backoff = getattr(h, "remark_backoff", 0.0)
    assert reached, backoff
    assert 1 <= remarks <= 8, remarks
    assert outbox_count(pg_dsn, schema) == 10


def test_fence_purges_in_flight_records_and_replaces_the_producer(pg_dsn, kafka_bootstrap, schema, topics):
    """The data producer's connections go through a proxy that then swallows all traffic, so its
    produce requests stay in flight (sent, never answered; with message.timeout.ms=0 librdkafka
    would retry them after a heal). The fence must leave nothing with the old producer."""
    topic = topics("data", partitions=1)
    leader = topics("leader", partitions=1)
    proxy = KafkaProxy(kafka_bootstrap)
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=leader)
    cfg.kafka.producer = {"bootstrap.servers": proxy.address}  # heartbeats go straight to Kafka
    receiver = Receiver(kafka_bootstrap, topic, 1)
    heartbeats = HeldHeartbeats()
    try:
        with running(cfg, faults=heartbeats, drain_timeout=1) as h:
            pub = h.publisher
            with psycopg.connect(pg_dsn) as c:
                insert_rows(c, schema, topic, [(b"k", b"k:%d" % i) for i in range(10)])
            assert receiver.wait_for({(b"k", b"k:%d" % i) for i in range(10)}, 30)  # the proxy works
            assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0, 30)
            proxy.swallow()
            old = pub.producer
            with psycopg.connect(pg_dsn) as c:
                insert_rows(c, schema, topic, [(b"k", b"k:%d" % i) for i in range(10, 210)])
            assert wait_until(lambda: len(old) == 200 and pub.produced >= 210, 30), (len(old), pub.produced)
            assert wait_until(lambda: proxy.swallowed_bytes > 0, 10), "no produce request was sent"
            assert pub.delivered == 10
            first_id = h.current_id
            reset_before, remarks_before = _counter("reset"), _counter("force_remarks")
            # No heartbeat until released below (a fixed hold could end before the checks that
            # need the fence on a loaded machine): fence after heartbeat_timeout (1 s).
            heartbeats.hold(600.0)
            assert wait_until(lambda: h.neli.state == "fenced", 10)
            # Everything the old producer held, queued AND in flight, is dropped and reported purged...
            assert wait_until(lambda: len(old) == 0, 10), f"{len(old)} records left with the fenced producer"
            assert wait_until(lambda: pub.producer is not old, 5), "the fenced leader kept its producer"
            assert wait_until(lambda: old not in pub.slot.retiring, 10)
            # ... the reports reset the rows under the old id (nothing deleted), settle the
            # throttle's count, and force no remark on whatever leadership comes next.
            assert wait_until(lambda: _counter("reset") - reset_before == 200, 5), _counter("reset") - reset_before
            assert h.neli.state == "fenced" and h.current_id in (None, first_id)
            assert pub.in_flight == 0 and pub.delivered == 10
            with psycopg.connect(pg_dsn) as c:
                assert c.execute(f'SELECT count(*) FROM "{schema}".outbox WHERE leader_id IS NULL').fetchone()[0] == 200
            assert _counter("force_remarks") == remarks_before
            # Heal: the leadership returns under a new id and publishes everything through the new
            # producer, in order.
            heartbeats.hold(0)
            proxy.heal()
            assert wait_until(lambda: h.leading and h.current_id not in (None, first_id), 15)
            assert receiver.wait_for({(b"k", b"k:%d" % i) for i in range(210)}, 60)
            assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0, 30)
        assert order_violations([(k, v) for k, v, _ in receiver.records]) == []
    finally:
        receiver.close()
        proxy.close()
