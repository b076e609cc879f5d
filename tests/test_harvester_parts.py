"""The publisher's parts on their own contracts: life cycle, settler counts, the producer slot."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
import pytest
from support.harness import insert_rows, lanes_config, make_config, outbox_count, outbox_marks, wait_until

from harvester.metrics import get as get_metrics
from harvester.publishing.deliveries import DeliverySettler
from harvester.publishing.marking import MarkedBatch
from harvester.publishing.outbox_sql import FOREVER, PURGE_RUN, OutboxStore, lane_of, make_pool, runs_of
from harvester.publishing.publisher import LifecycleError, Publisher, producer_config
from harvester.units import Harvester
from tracker.message_ids import Namespace

NS = Namespace(uuid.UUID(int=0))  # the message-id namespace of records produced directly


def test_a_harvester_starts_once_and_never_after_stop(pg_dsn, kafka_bootstrap, schema, topics):
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=topics("leader", partitions=1))
    h = Harvester(cfg)
    assert h.stop(1) is True  # stopping one never started is harmless
    with pytest.raises(LifecycleError, match="stopped"):
        h.start()
    h = Harvester(cfg).start()
    try:
        with pytest.raises(LifecycleError, match="started"):
            h.start()
    finally:
        h.stop(2)
    assert h.stop(2) is True  # twice: nothing more to do
    with pytest.raises(LifecycleError, match="stopped"):
        h.start()


def test_batches_left_queued_after_the_threads_ended_are_released_not_counted_in_flight(
    pg_dsn, kafka_bootstrap, schema, topics
):
    """The stop's last step (a thread that outlived its join can leave marked batches queued):
    their rows stop counting as in flight, and the stop does not fail on them."""
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=topics("leader", partitions=1))
    h = Harvester(cfg).start()
    h.stop(5)
    unit = h.units[0]
    assert unit.publisher is not None and unit.publisher.in_flight == 0
    rows = [(i, "t", b"k", b"v", [], [], None, NS.message_id(i, 0)) for i in range(7)]
    for batch in (rows[:4], rows[4:]):
        unit.publisher.reserve(len(batch))
        unit._batches.put(MarkedBatch(uuid.uuid4(), batch, time.monotonic()))
    assert unit.publisher.in_flight == 7
    unit._release_unproduced()
    assert unit.publisher.in_flight == 0 and unit._batches.empty()


def test_a_publisher_starts_once(pg_dsn, kafka_bootstrap, schema):
    pool = make_pool(pg_dsn, 1)
    try:
        pub = Publisher(producer_config(kafka_bootstrap, {}, {}), OutboxStore(pool, schema), get_metrics()).start()
        with pytest.raises(LifecycleError):
            pub.start()
        pub.close()
        pub.close()
        with pytest.raises(LifecycleError):
            pub.start()
    finally:
        pool.close()


def test_settler_counts_every_report_once_with_many_workers_and_reporting_threads(pg_dsn, schema, topics):
    """Four reporting threads and four settling workers: the counters the remark back-off reads
    (delivered, purged_rows) and the throttle's count end exact."""
    topic = topics("data", partitions=1)
    n, threads = 8000, 4
    with psycopg.connect(pg_dsn) as conn:
        insert_rows(conn, schema, topic, [(b"k%d" % (i % 50), b"v%d" % i) for i in range(n)])
    pool = make_pool(pg_dsn, 5)
    try:
        store = OutboxStore(pool, schema)
        me = uuid.uuid4()
        rows = store.mark(me, n, until=FOREVER)
        assert len(rows) == n
        settler = DeliverySettler(store, get_metrics(), batch=97, workers=4)
        settler.start()
        settler.reserve(n)
        ids = [r[0] for r in rows]

        def report(part: list[int]) -> None:
            for row_id in part:
                settler.report(row_id, me, None, _Msg())

        ts = [threading.Thread(target=report, args=(ids[i::threads],)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert settler.drain(60), settler.in_flight
        settler.stop(10)
        assert (settler.delivered, settler.purged_rows, settler.dead_rows, settler.in_flight) == (n, n, 0, 0)
        assert settler.progress == n
        assert outbox_count(pg_dsn, schema) == 0
    finally:
        pool.close()


class _Msg:
    def latency(self) -> float:
        return 0.001


def test_runs_of_covers_exactly_the_ids_given():
    long = list(range(1000, 1000 + PURGE_RUN))
    assert runs_of(long) == ([(1000, 1000 + PURGE_RUN - 1)], [])
    assert runs_of(long[::-1] + long[:5]) == ([(1000, 1000 + PURGE_RUN - 1)], [])  # any order, duplicates
    assert runs_of(long[:-1]) == ([], long[:-1])  # too short for a range
    # As many ids as the span, yet not the span: a duplicate must not stand for the id it hides.
    tricky = [5, 5, *range(7, 7 + PURGE_RUN)]
    assert runs_of(tricky) == ([(7, 6 + PURGE_RUN)], [5])
    gapped = [*range(1, 1 + PURGE_RUN), *range(2 + PURGE_RUN, 4 + PURGE_RUN), *range(500, 500 + 2 * PURGE_RUN)]
    assert runs_of(gapped) == (
        [(1, PURGE_RUN), (500, 499 + 2 * PURGE_RUN)],
        [2 + PURGE_RUN, 3 + PURGE_RUN],
    )
    assert runs_of([]) == ([], [])


def test_purge_deletes_exactly_the_ids_given_still_marked_by_the_leader_id(pg_dsn, schema, conn):
    n = 4 * PURGE_RUN
    insert_rows(conn, schema, "t", [(b"k", b"v%d" % i) for i in range(n)])
    pool = make_pool(pg_dsn, 1)
    try:
        store = OutboxStore(pool, schema)
        me, other = uuid.uuid4(), uuid.uuid4()
        ids = [r[0] for r in store.mark(me, n, until=FOREVER)]
        assert len(ids) == n
        taken_over = ids[10]  # inside a run, remarked by a newer id meanwhile
        conn.execute(f'UPDATE "{schema}".outbox SET leader_id = %s WHERE id = %s', [other, taken_over])
        conn.commit()
        left_out = {ids[PURGE_RUN + 5], ids[3 * PURGE_RUN + 1]}  # inside the span of what is purged
        given = [i for i in ids[: 2 * PURGE_RUN] + ids[3 * PURGE_RUN :] if i not in left_out]
        given += ids[2 * PURGE_RUN : 2 * PURGE_RUN + 3] + given[:7]  # a few singles, duplicates
        expect_gone = set(given) - {taken_over}
        assert store.purge(me, given) == len(expect_gone)
        left = outbox_marks(pg_dsn, schema)
        assert set(left) == set(ids) - expect_gone
        assert left[taken_over] == other and all(left[i] == me for i in left_out)
        assert store.purge(me, given) == 0  # already gone
    finally:
        pool.close()


def test_mark_takes_the_lowest_rows_not_marked_by_its_id_and_leaves_its_own(pg_dsn, schema, conn):
    insert_rows(conn, schema, "t", [(b"k", b"v%d" % i) for i in range(20)])
    pool = make_pool(pg_dsn, 1)
    try:
        store = OutboxStore(pool, schema)
        me, other = uuid.uuid4(), uuid.uuid4()
        ids = sorted(outbox_marks(pg_dsn, schema))
        mine, others = [ids[2], ids[3], ids[7]], [ids[4], ids[10]]
        conn.execute(f'UPDATE "{schema}".outbox SET leader_id = %s WHERE id = ANY(%s)', [me, mine])
        conn.execute(f'UPDATE "{schema}".outbox SET leader_id = %s WHERE id = ANY(%s)', [other, others])
        conn.commit()
        got = [r[0] for r in store.mark(me, 6, until=FOREVER)]
        assert got == [ids[0], ids[1], ids[4], ids[5], ids[6], ids[8]]
        after = outbox_marks(pg_dsn, schema)
        assert [i for i in ids if after[i] == me] == sorted(got + mine)
        assert after[ids[10]] == other and after[ids[9]] is None
        assert [r[0] for r in store.mark(me, 100, until=FOREVER)] == [i for i in ids if i not in got + mine]
        assert store.mark(me, 100, until=FOREVER) == []
    finally:
        pool.close()


def test_a_delivered_record_is_purged_without_waiting_for_the_rest_of_its_produce_call(pg_dsn, schema, conn):
    """k1 and x go in one produce call, k2 (k1's key) in the next; k1 and k2 are delivered while x
    (another partition, say) has no report yet. Both are purged: were k1 held for x, k2 purged
    first, and a remark then, k1 would be published again after k2, its key's last value going
    back. Through PlainStrategy's own wiring, with a producer that only keeps the callbacks."""
    from harvester.publishing.idempotent import PlainStrategy
    from harvester.publishing.producer_slot import ProducerSlot

    class Held:  # keeps each record's delivery callback; nothing reaches a broker
        def __init__(self, conf: dict) -> None:
            self.callbacks: list = []

        def produce(self, topic, value, key, partition, callback, on_delivery, timestamp, headers) -> None:
            self.callbacks.append(callback)

    insert_rows(conn, schema, "t", [(b"k", b"1"), (b"x", b"x"), (b"k", b"2")])
    pool = make_pool(pg_dsn, 2)
    try:
        store = OutboxStore(pool, schema)
        me = uuid.uuid4()
        k1, x, k2 = [r[0] for r in store.mark(me, 10, until=FOREVER)]
        settler = DeliverySettler(store, get_metrics(), workers=2, on_failure=lambda why: None)
        settler.start()
        slot = ProducerSlot({}, Held)
        plain = PlainStrategy(slot, settler, store)

        def rows(*ids: int) -> list[tuple]:
            return [(i, "t", b"k", b"v", [], [], None, NS.message_id(i, 0)) for i in ids]

        settler.reserve(3)
        assert plain.produce_rows(rows(k1, x), me, lambda: True, lambda: float("inf")) == 2
        assert plain.produce_rows(rows(k2), me, lambda: True, lambda: float("inf")) == 1
        first, unreported, second = slot.current.callbacks
        first(None, _Msg())
        second(None, _Msg())
        assert wait_until(lambda: settler.purged_rows == 2, 10), settler.purged_rows
        assert outbox_marks(pg_dsn, schema) == {x: me}
        unreported(None, _Msg())
        assert settler.drain(10)
        settler.stop(10)
        assert outbox_marks(pg_dsn, schema) == {}
    finally:
        pool.close()


def test_a_reaper_that_never_led_retires_no_producer(pg_dsn, kafka_bootstrap, schema, topics):
    leader = topics("leader", partitions=1)
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=leader)
    a = Harvester(cfg).start()
    b = None
    try:
        assert wait_until(lambda: a.leading, 30)
        b = Harvester(
            make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=leader, group=cfg.harvester.leader_group)
        ).start()
        time.sleep(2)  # b joined the group and was given nothing
        assert not b.leading
        b.stop(2)
        assert b.publisher.retired == 0, "a standby retired a producer it never used"
        b = None
    finally:
        if b is not None:
            b.stop(2)
        a.stop(2)
    assert a.publisher.retired == 0  # led, but never produced a record: nothing to drop on stop


def test_a_transactional_slot_holds_a_set_of_producers_taken_in_turn_and_retired_together(kafka_bootstrap):
    from confluent_kafka import Producer

    from harvester.publishing.producer_slot import ProducerSlot

    made: list[dict] = []

    def factory(conf: dict) -> Producer:
        made.append(conf)
        return Producer(conf)

    conf = producer_config(kafka_bootstrap, {}, {}, transactional_id="slot-test")
    assert conf["linger.ms"] == 0 and conf["socket.nagle.disable"] is True  # the transactional defaults
    assert producer_config(kafka_bootstrap, {}, {"linger.ms": 7}, transactional_id="x")["linger.ms"] == 7
    assert producer_config(kafka_bootstrap, {}, {})["linger.ms"] == 2 and "transactional.id" not in producer_config(
        kafka_bootstrap, {}, {}
    )
    with pytest.raises(ValueError, match="producers must be >= 1"):
        ProducerSlot(conf, factory, producers=0)
    with pytest.raises(ValueError, match="transactional publishing only"):
        ProducerSlot(producer_config(kafka_bootstrap, {}, {}), factory, producers=2)
    made.clear()
    slot = ProducerSlot(conf, factory, producers=3)
    slot.start()
    assert [c["transactional.id"] for c in made] == ["slot-test", "slot-test#1", "slot-test#2"]
    first = slot.producers
    assert slot.current is first[0]
    slot.rotate(after=first[0])
    assert slot.current is first[1]
    slot.rotate(after=first[0])  # stale: first[0] is no longer current, nothing moves
    assert slot.current is first[1]
    slot.rotate(after=first[1])
    slot.rotate(after=first[2])
    assert slot.current is first[0]
    assert not slot.retire("unused")  # nothing was ever sent or begun: the set is kept
    slot.used = True
    assert slot.retire("test")
    assert slot.current is slot.producers[0] and not any(p is q for p in slot.producers for q in first)
    assert slot.retired == 1 and wait_until(lambda: not slot.retiring, 5)  # served until empty, then let go
    slot.rotate(after=first[0])  # a producer of the retired set: nothing moves
    assert slot.current is slot.producers[0]
    slot.close(1)


def test_a_fenced_leader_fences_at_once_and_a_standby_never_does(pg_dsn, kafka_bootstrap, schema, topics):
    """Leadership starts with init_transactions on every producer of the set (before any row);
    a standby of the same transactional id initialises nothing: that would fence the leader."""
    from harvester.publishing.transactional import TXN_PRODUCERS

    leader, data = topics("leader", partitions=1), topics("data", partitions=3)
    txn_id = f"parts-{uuid.uuid4().hex[:8]}"
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=leader, harvester={"transactional_id": txn_id})
    a = Harvester(cfg).start()
    b = None
    try:
        assert wait_until(lambda: a.leading, 30)
        assert wait_until(lambda: a.publisher.strategy.ready, 30), "not fenced before rows"
        assert len(a.publisher.slot.producers) == TXN_PRODUCERS
        b = Harvester(
            make_config(
                pg_dsn,
                schema,
                kafka_bootstrap,
                leader_topic=leader,
                group=cfg.harvester.leader_group,
                harvester={"transactional_id": txn_id},
            )
        ).start()
        time.sleep(2)
        assert not b.leading and not b.publisher.strategy.ready and not b.publisher.slot.used
        with psycopg.connect(pg_dsn) as conn:
            insert_rows(conn, schema, data, [(b"k%d" % (i % 5), b"v%d" % i) for i in range(100)])
        assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0, 30), "the leader stopped publishing"
        assert a.publisher.txn_committed > 0 and a.publisher.txn_aborted == 0
    finally:
        if b is not None:
            b.stop(2)
        a.stop(2)


def _keys_in_lanes(wanted: set[int], lanes: int, n: int) -> list[bytes]:
    keys, i = [], 0
    while len(keys) < n:
        if lane_of(b"k%d" % i, lanes) in wanted:
            keys.append(b"k%d" % i)
        i += 1
    return keys


@pytest.mark.parametrize("purging", [{0}, {1}, {0, 1}], ids=["lane0", "lane1", "both"])
def test_the_leader_of_lane_0_vacuums_while_any_lane_purges_and_no_other_lane_does(
    pg_dsn, kafka_bootstrap, schema, topics, purging
):
    """One VACUUM of the table at a time, lane 0's: also when only other lanes delete rows (keys
    that all hash elsewhere), which it learns from the table's statistics."""
    lanes = 2
    data = topics("data", partitions=2)
    cfg = lanes_config(pg_dsn, schema, kafka_bootstrap, topics, lanes, vacuum_interval=0.2)
    keys = _keys_in_lanes(purging, lanes, 50)
    h = Harvester(cfg).start()
    try:
        assert wait_until(lambda: all(u.leading for u in h.units), 30)
        time.sleep(1)
        assert h.units[0].vacuums == 0  # nothing purged yet: nothing to vacuum
        for round_ in range(5):
            with psycopg.connect(pg_dsn) as conn:
                insert_rows(conn, schema, data, [(k, b"v%d" % round_) for k in keys * 10])
            assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0, 30)
            time.sleep(0.3)
        assert [u.publisher.purged_rows > 0 for u in h.units] == [lane in purging for lane in range(lanes)]
        assert wait_until(lambda: h.units[0].vacuums >= 1, 10), "rows were purged, the outbox never vacuumed"
        assert h.units[1].vacuums == 0
    finally:
        h.stop(5)
