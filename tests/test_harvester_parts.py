"""The publisher's parts on their own contracts: life cycle, settler counts, the producer slot."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import psycopg
import pytest
from support.harness import insert_rows, lanes_config, make_config, outbox_count, wait_until

from harvester.metrics import get as get_metrics
from harvester.publishing.deliveries import DeliverySettler
from harvester.publishing.outbox_sql import FOREVER, PURGE_RUN, MarkRefused, OutboxStore, lane_of, make_pool, runs_of
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


def _outbox(pg_dsn: str, schema: str) -> dict[int, uuid.UUID | None]:
    with psycopg.connect(pg_dsn) as c:
        return dict(c.execute(f'SELECT id, leader_id FROM "{schema}".outbox ORDER BY id').fetchall())


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
        left = _outbox(pg_dsn, schema)
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
        ids = sorted(_outbox(pg_dsn, schema))
        mine, others = [ids[2], ids[3], ids[7]], [ids[4], ids[10]]
        conn.execute(f'UPDATE "{schema}".outbox SET leader_id = %s WHERE id = ANY(%s)', [me, mine])
        conn.execute(f'UPDATE "{schema}".outbox SET leader_id = %s WHERE id = ANY(%s)', [other, others])
        conn.commit()
        got = [r[0] for r in store.mark(me, 6, until=FOREVER)]
        assert got == [ids[0], ids[1], ids[4], ids[5], ids[6], ids[8]]
        after = _outbox(pg_dsn, schema)
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
        assert plain.produce_rows(rows(k1, x), me, lambda: True, lambda: float("inf"), NS) == 2
        assert plain.produce_rows(rows(k2), me, lambda: True, lambda: float("inf"), NS) == 1
        first, unreported, second = slot.current.callbacks
        first(None, _Msg())
        second(None, _Msg())
        assert wait_until(lambda: settler.purged_rows == 2, 10), settler.purged_rows
        assert _outbox(pg_dsn, schema) == {x: me}
        unreported(None, _Msg())
        assert settler.drain(10)
        settler.stop(10)
        assert _outbox(pg_dsn, schema) == {}
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


class _PausedBeforeMark:
    """The outbox store, with the first mark held back `pause` seconds between the marker's lease
    check and the statement reaching the server: a SIGSTOP or VM pause landing just there."""

    def __init__(self, store, pause: float) -> None:
        self._store, self._pause = store, pause
        self.results: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def mark(self, leader_id, limit, *args, **kw):
        if not self.results:
            time.sleep(self._pause)
        try:
            rows = self._store.mark(leader_id, limit, *args, **kw)
        except MarkRefused:
            self.results.append("refused")
            raise
        self.results.append(len(rows))
        return rows


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_mark_sent_after_the_lease_ended_marks_nothing(pg_dsn, kafka_bootstrap, schema, topics, lanes):
    """The server itself refuses a mark that reaches it after the leadership it was checked under
    ended: a leader paused between its lease check and its mark takes no row from its successor."""
    from harvester.config import units
    from harvester.election.lease import Lease
    from harvester.publishing.mark_purge_reset import UnitHarvester
    from harvester.publishing.ports import Providers

    data = topics("data", partitions=1)
    with psycopg.connect(pg_dsn) as conn:
        insert_rows(conn, schema, data, [(b"k%d" % i, b"v%d" % i) for i in range(40)])
    in_lane = sum(1 for i in range(40) if lane_of(b"k%d" % i, lanes) == 0)
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, harvester={"lanes": lanes})
    spec = units(cfg)[0]  # lane 0 of `lanes`: the rows of its keys
    paused: list[_PausedBeforeMark] = []

    def wrap(store):
        paused.append(_PausedBeforeMark(store, pause=2.0))
        return paused[-1]

    unit = UnitHarvester(cfg, spec, providers=Providers(store=wrap, description="paused before mark"))
    lease = Lease(0, hb_timeout=1.0, metrics=get_metrics(), on_change=lambda s, lid: None)
    lease.acquire()  # leads for 1 s: no heartbeat will come
    unit.start(lease)
    try:
        assert wait_until(lambda: paused and paused[0].results, 10), "the marker never marked"
        assert paused[0].results[0] == "refused", "a mark sent after the lease ended was not refused"
        with psycopg.connect(pg_dsn) as conn:
            marked = conn.execute(f'SELECT count(*) FROM "{schema}".outbox WHERE leader_id IS NOT NULL').fetchone()[0]
        assert marked == 0
        assert outbox_count(pg_dsn, schema) == 40
        lease.hb_timeout = 60.0  # heartbeats are back: the same marker leads again, from the head
        lease.last_heartbeat = time.monotonic()
        assert wait_until(lambda: outbox_count(pg_dsn, schema) == 40 - in_lane, 30), "the marker did not resume"
    finally:
        unit.finish(2)
        unit.close()


@pytest.mark.parametrize("max_age", [0.0, 1.0])
def test_the_database_clock_maps_a_deadline_early_never_late(pg_dsn, schema, max_age):
    """A monotonic time mapped onto the server's clock is never later than the server's own reading
    of that moment (so a mark's deadline can only err towards refusing), and off by about a round trip."""
    from harvester.election.db_clock import DatabaseClock

    pool = make_pool(pg_dsn, 1)
    try:
        store = OutboxStore(pool, schema)
        clock = DatabaseClock(store.database_now, max_age=max_age)
        for _ in range(50):
            mapped = clock.at(time.monotonic())
            server = store.database_now()
            assert mapped <= server
            assert (server - mapped).total_seconds() < 0.1
    finally:
        pool.close()


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_mark_that_finishes_after_its_deadline_is_taken_back(pg_dsn, schema, topics, lanes):
    """A mark that reached the server in time but waited on a row lock past its deadline marks
    nothing: the check after it, in the same implicit transaction, takes it back."""
    from harvester.election.db_clock import DatabaseClock
    from harvester.publishing.outbox_sql import MarkRefused

    data = topics("data", partitions=1)
    with psycopg.connect(pg_dsn) as conn:
        insert_rows(conn, schema, data, [(b"k%d" % i, b"v%d" % i) for i in range(20)])
    pool = make_pool(pg_dsn, 2)
    holder = psycopg.connect(pg_dsn)
    try:
        store = OutboxStore(pool, schema, lane=lane_of(b"k0", lanes), lanes=lanes)
        clock = DatabaseClock(store.database_now)
        holder.execute(f'SELECT id FROM "{schema}".outbox ORDER BY id LIMIT 1 FOR UPDATE')  # k0's row
        outcome: list[object] = []

        def mark() -> None:
            try:
                outcome.append(store.mark(uuid.uuid4(), 20, until=clock.at(time.monotonic() + 0.5)))
            except MarkRefused as exc:
                outcome.append(exc)

        marker = threading.Thread(target=mark)
        marker.start()
        time.sleep(1.5)
        holder.rollback()  # the lock goes 1 s after the deadline: the mark finishes then
        marker.join(10)
        assert len(outcome) == 1 and isinstance(outcome[0], MarkRefused), outcome
        with psycopg.connect(pg_dsn) as conn:
            marked = conn.execute(f'SELECT count(*) FROM "{schema}".outbox WHERE leader_id IS NOT NULL').fetchone()[0]
        assert marked == 0
        # In time, the same mark goes through.
        assert store.mark(uuid.uuid4(), 20, until=clock.at(time.monotonic() + 5))
    finally:
        holder.close()
        pool.close()


@pytest.mark.parametrize(
    "server_now",
    [
        # Half a second before New York's clocks go back (EDT), and inside the repeated hour (EST).
        datetime(2026, 11, 1, 1, 59, 59, 500000, tzinfo=ZoneInfo("America/New_York")),
        datetime(2026, 11, 1, 1, 30, tzinfo=ZoneInfo("America/New_York"), fold=1),
        datetime(2026, 3, 8, 1, 59, 59, 500000, tzinfo=ZoneInfo("America/New_York")),
    ],
    ids=["before-fall-back", "repeated-hour", "before-spring-forward"],
)
def test_the_database_clock_counts_in_elapsed_time_across_a_daylight_saving_change(server_now):
    """A server whose TimeZone has daylight saving returns zoned times; a deadline five seconds on
    is five elapsed seconds on, not five seconds on the local wall clock (an hour off across a change)."""
    from harvester.election.db_clock import DatabaseClock

    clock = DatabaseClock(lambda: server_now)
    clock.refresh()
    local = time.monotonic()
    mapped = clock.at(local + 5.0)
    # In UTC: Python subtracts two datetimes of one tzinfo by their wall clocks, shift or not.
    elapsed = (mapped.astimezone(UTC) - server_now.astimezone(UTC)).total_seconds()
    assert 4.999 < elapsed < 5.1, elapsed  # and not 3,605 or 1,795


def test_the_leader_of_lane_0_vacuums_while_it_purges_and_no_other_lane_does(pg_dsn, kafka_bootstrap, schema, topics):
    lanes = 2
    data = topics("data", partitions=2)
    cfg = lanes_config(pg_dsn, schema, kafka_bootstrap, topics, lanes, vacuum_interval=0.2)
    h = Harvester(cfg).start()
    try:
        assert wait_until(lambda: all(u.leading for u in h.units), 30)
        assert h.units[0].vacuums == 0  # nothing purged yet: nothing to vacuum
        for round_ in range(5):
            with psycopg.connect(pg_dsn) as conn:
                insert_rows(conn, schema, data, [(b"k%d" % i, b"v%d" % round_) for i in range(500)])
            assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0, 30)
            time.sleep(0.3)
        assert h.units[0].vacuums >= 1 and h.units[1].vacuums == 0
    finally:
        h.stop(5)


def test_a_revocation_lets_the_unit_go_only_once_no_mark_is_on_its_way(kafka_bootstrap):
    """A mark checked its lease just before a rebalance took the unit away: the revocation callback
    (after which the group hands the partition on) returns only once that mark has returned, or once
    the database can no longer accept it (its deadline), and no mark starts after it. A lost
    partition (already handed on by the group) is not held back beyond a short bound."""
    from confluent_kafka import Consumer, TopicPartition

    from harvester.election.neli import FOLLOWER, Neli

    neli = Neli(
        bootstrap=kafka_bootstrap,
        client={},
        consumer={},
        producer={},
        topic="not-used",
        group=f"g-{uuid.uuid4().hex[:8]}",
        min_poll_interval=0.1,
        heartbeat_timeout=4.0,
        session_timeout=10.0,
        metrics=get_metrics(),
        units=2,
    )
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"g-{uuid.uuid4().hex[:8]}"})
    neli._consumer = consumer  # the callback acts only for its current consumer

    def marking(unit: int, hold: float) -> tuple[threading.Thread, threading.Event, float]:
        """A mark on its way for `hold` seconds; returns its thread, its end, and the deadline after
        which the database refuses it."""
        lease = neli.lease(unit)
        lease.holding = True
        lease.acquire()
        entered, released = threading.Event(), threading.Event()

        def mark() -> None:
            with lease.marking() as leader_id:
                assert leader_id is not None
                entered.set()
                time.sleep(hold)
            released.set()

        thread = threading.Thread(target=mark, daemon=True)
        thread.start()
        assert entered.wait(5)
        return thread, released, lease.marks_accepted_until()

    try:
        # A short mark, one longer than the first bound (heartbeat_timeout / 4), one that outlasts
        # its deadline: the partition goes once the mark is back, or once it is past its deadline.
        for hold in (0.5, 2.0, 30.0):
            thread, released, deadline = marking(0, hold)
            neli._on_revoke(consumer, [TopicPartition("not-used", 0)])
            returned = time.monotonic()
            assert neli.lease(0).state == FOLLOWER
            assert released.is_set() or returned >= deadline, (hold, returned, deadline)
            with neli.lease(0).marking() as leader_id:
                assert leader_id is None  # nothing starts after the revocation
            if hold < 30:
                thread.join(5)
        # Two units revoked at once, each with a mark longer than the first bound: both are waited for.
        marks = [marking(unit, 2.0) for unit in (0, 1)]
        neli._on_revoke(consumer, [TopicPartition("not-used", 0), TopicPartition("not-used", 1)])
        assert all(released.is_set() for _, released, _ in marks)
        assert neli.lease(0).state == neli.lease(1).state == FOLLOWER
        # Lost (the group already gave the partition away): waiting would protect nothing, and the
        # other units' heartbeats wait for this thread, so only the short bound applies.
        thread, released, deadline = marking(0, 30.0)
        neli._on_lost(consumer, [TopicPartition("not-used", 0)])
        assert time.monotonic() < deadline and not released.is_set()
        assert neli.lease(0).state == FOLLOWER
    finally:
        consumer.close()


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_mark_waiting_on_a_lock_takes_only_its_snapshot_rows_still_unmarked_by_it(pg_dsn, schema, conn, lanes):
    """The mark's rows are its own snapshot's: a row committed meanwhile inside the id range it walks
    (an id taken before the rows above it) is left for the next mark, and a row taken by its own id
    while the mark waited on its lock is neither marked again nor returned (the row-level re-check)."""
    key = b"k"  # one key: with two lanes every row is in the lane of this key
    lane = lane_of(key, lanes)
    insert_rows(conn, schema, "t", [(key, b"a%d" % i) for i in range(3)])
    before = sorted(_outbox(pg_dsn, schema))
    me = uuid.uuid4()
    late = psycopg.connect(pg_dsn)
    pool = make_pool(pg_dsn, 1)
    try:
        late_id = late.execute(
            f'INSERT INTO "{schema}".outbox (topic, key, value) VALUES (%s, %s, %s) RETURNING id', ["t", key, b"late"]
        ).fetchone()[0]
        late.execute(f'UPDATE "{schema}".outbox SET value = %s WHERE id = %s', [b"changed", before[1]])
        late.execute(f'UPDATE "{schema}".outbox SET leader_id = %s WHERE id = %s', [me, before[2]])
        insert_rows(conn, schema, "t", [(key, b"b%d" % i) for i in range(3)])
        after = sorted(set(_outbox(pg_dsn, schema)) - set(before))
        assert late_id < after[0]
        store = OutboxStore(pool, schema, lane=lane, lanes=lanes)
        got: list = []
        marking = threading.Thread(target=lambda: got.append(store.mark(me, 100, until=FOREVER)))
        marking.start()
        watch = psycopg.connect(pg_dsn, autocommit=True)
        waiting = (
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%%SET leader_id%%' "
            "AND position(%s in query) > 0"
        )
        try:
            assert wait_until(lambda: watch.execute(waiting, [f'"{schema}"']).fetchone()[0] > 0, 10), (
                "the mark never waited on the row lock"
            )
        finally:
            watch.close()
        late.commit()
        marking.join(10)
        assert [r[0] for r in got[0]] == [before[0], before[1], *after]
        rows = _outbox(pg_dsn, schema)
        assert rows[late_id] is None and rows[before[2]] == me
        assert [r[0] for r in store.mark(me, 100, until=FOREVER)] == [late_id]
    finally:
        late.close()
        pool.close()
