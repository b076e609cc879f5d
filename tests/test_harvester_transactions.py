"""harvester.transactional_id: publishing in Kafka transactions, and the broker fencing an old leader.

The receiver reads with librdkafka's default isolation.level=read_committed, as a consumer of a
transactional outbox should.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from functools import partial
from types import SimpleNamespace

import psycopg
import pytest
from confluent_kafka import KafkaError, KafkaException, Producer
from support.faults import FaultPlan
from support.harness import insert_rows, outbox_count, wait_until
from test_harvester_pipeline import PARTITIONS, _publish_all_in_order, setup  # noqa: F401 (fixture)

from harvester.metrics import get as get_metrics
from harvester.publishing.outbox_sql import FOREVER, OutboxStore, make_pool
from harvester.publishing.ports import Providers
from harvester.publishing.publisher import Publisher, producer_config
from harvester.publishing.transactional import TXN_PRODUCERS, TransactionalStrategy
from tracker.message_ids import Namespace

NS = Namespace(uuid.UUID(int=0))  # the message-id namespace of records produced directly


def _txn_id() -> str:
    return f"reaper-test-{uuid.uuid4().hex[:10]}"


def test_transactional_publishing_keeps_order_and_loses_nothing_under_faults(setup, pg_dsn, schema):  # noqa: F811
    make, topic, receiver = setup
    m = get_metrics()
    aborted = m.txn_aborted._value.get()
    # One failed record aborts its whole transaction (a mark batch): rates low enough for most to commit.
    faults = FaultPlan(delivery_error_rate=0.002, produce_error_rate=0.001, seed=11)
    h = _publish_all_in_order(pg_dsn, schema, topic, receiver, make(mark_batch=100, transactional_id=_txn_id()), faults)
    assert h.publisher.txn_committed > 0
    assert m.txn_aborted._value.get() > aborted  # failed records aborted their transaction; all came again


def _publisher(kafka_bootstrap, store, txn_id):
    conf = producer_config(kafka_bootstrap, {}, {})
    conf["transactional.id"] = txn_id
    failures: list[str] = []
    pub = Publisher(conf, store, get_metrics(), purge_workers=1, on_failure=failures.append).start()
    return pub, failures


def _open_and_write(pub, rows, leader_id):
    """What produce_rows does up to its commit: open the transaction, write the rows; no commit
    (the process "pauses" here). Returns the transaction's sequence number."""
    seq = pub.strategy.begin(pub.producer, lambda: True, lambda: time.monotonic() + 60)
    assert seq is not None
    _write(pub, seq, rows, leader_id)
    return seq


def _write(pub, seq, rows, leader_id):
    for row_id, topic, key, value, _, _, _, _ in rows:
        pub.producer.produce(topic, value, key, on_delivery=partial(pub.strategy.report, seq, row_id, leader_id))


@contextlib.contextmanager
def _paused_leader(pg_dsn, kafka_bootstrap, schema, topic, values, keys, txn_id=None, write=None):
    """A leader that marked `values` (key k<i % keys>), wrote the first `write` of them (all by
    default) in an open transaction and then "paused". Yields its store, publisher, failures
    (remarks raised), leader id, marked rows and transaction sequence; closes it all afterwards."""
    with psycopg.connect(pg_dsn) as conn:
        insert_rows(conn, schema, topic, [(b"k%d" % (i % keys), v) for i, v in enumerate(values)])
    pool = make_pool(pg_dsn, 3)
    pub = None
    try:
        store = OutboxStore(pool, schema)
        pub, failures = _publisher(kafka_bootstrap, store, txn_id or _txn_id())
        me = uuid.uuid4()
        rows = store.mark(me, len(values), until=FOREVER)
        assert len(rows) == len(values)
        pub.reserve(len(rows))
        seq = _open_and_write(pub, rows[:write], me)
        yield SimpleNamespace(store=store, pub=pub, failures=failures, me=me, rows=rows, seq=seq)
    finally:
        if pub is not None:
            pub.close()
        pool.close()


def _read_all(kafka_bootstrap, topic, expect_at_least, timeout=30.0):
    from confluent_kafka import Consumer

    c = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"t-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )  # read_committed by default
    c.subscribe([topic])
    seen, deadline, quiet_until = [], time.monotonic() + timeout, None
    try:
        while time.monotonic() < deadline:
            msg = c.poll(0.2)
            if msg is not None and not msg.error():
                seen.append(msg.value())
                continue
            if len(seen) >= expect_at_least:
                quiet_until = quiet_until or time.monotonic() + 3.0  # then make sure nothing else follows
                if time.monotonic() >= quiet_until:
                    break
    finally:
        c.close()
    return seen


def test_a_new_leader_fences_the_old_leaders_producer_at_the_broker(pg_dsn, kafka_bootstrap, schema, topics):
    """The SIGSTOP hazard, made deterministic: leader A has records written in an open transaction
    and more waiting in its producer when B takes over. B's first transaction fences A: A's
    transaction is aborted, A's later records are refused, and a read_committed consumer sees every
    row exactly once, from B."""
    topic = topics("data", partitions=PARTITIONS)
    txn_id = _txn_id()
    b = None
    try:
        # A opens its transaction and writes 150 of its 200 rows, then is "paused" before it can commit.
        with _paused_leader(
            pg_dsn,
            kafka_bootstrap,
            schema,
            topic,
            [b"row-%d" % i for i in range(200)],
            keys=5,
            txn_id=txn_id,
            write=150,
        ) as a_leader:
            a, store, rows, me_a, seq = a_leader.pub, a_leader.store, a_leader.rows, a_leader.me, a_leader.seq
            assert wait_until(lambda: len(a.producer) == 0, 30)  # written to the log, inside A's open transaction
            assert a.txn_committed == 0
            assert a.strategy.ready  # A initialised every id of its set: each one is B's to fence

            # B takes over: remarks everything from the head, publishes and commits.
            b, _ = _publisher(kafka_bootstrap, store, txn_id)
            me_b = uuid.uuid4()
            rows_b = store.mark(me_b, 500, until=FOREVER)
            assert len(rows_b) == 200
            b.reserve(len(rows_b))
            assert b.produce_rows(rows_b, me_b, lambda: True, lambda: time.monotonic() + 60) == 200
            assert b.txn_committed == 1
            assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0, 30), "B's committed rows were not purged"

            # A "resumes": it sends the records it still held, then commits. The broker refuses both.
            with contextlib.suppress(KafkaException):  # refused at once if A already knows it is fenced
                _write(a, seq, rows[150:], me_a)
            a.strategy.finish(a.producer, lambda: time.monotonic() + 60)
            assert a.txn_committed == 0, "the fenced producer committed a transaction"
            assert len(a.slot.producers) == TXN_PRODUCERS >= 2
            for producer in a.slot.producers:  # every transactional id of A's set, not only the one it used
                with pytest.raises(KafkaException) as refused:
                    producer.begin_transaction()
                    producer.produce(topic, value=b"late", key=b"k0")
                    producer.commit_transaction(10)
                assert refused.value.args[0].code() in (
                    KafkaError._FENCED,
                    KafkaError._STATE,
                    KafkaError._FATAL,
                    KafkaError.PRODUCER_FENCED,
                    KafkaError.INVALID_PRODUCER_EPOCH,
                )
            assert a_leader.failures, "the fenced leader did not raise a remark"
            values = _read_all(kafka_bootstrap, topic, expect_at_least=200)
            assert sorted(values) == sorted(b"row-%d" % i for i in range(200)), (
                f"{len(values)} records visible, {len(set(values))} distinct: the old leader's writes leaked"
            )
    finally:
        if b is not None:
            b.close()


def test_a_record_the_broker_refuses_aborts_its_transaction_and_publishing_resumes_once_fixed(
    pg_dsn, kafka_bootstrap, schema, topics
):
    """A broker-side refusal puts librdkafka's transaction in an abortable state in which every
    later produce() fails too: the reaper must abort it, not keep producing into it, so that once
    the operator fixes the cause the next transaction goes through."""
    from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource
    from support.harness import make_config

    from harvester.units import Harvester

    topic = topics("data", partitions=2, config={"max.message.bytes": "2000"})
    leader = topics("leader", partitions=1)
    big = os.urandom(5000)  # incompressible: above the topic's limit even after lz4
    with psycopg.connect(pg_dsn) as conn:
        insert_rows(conn, schema, topic, [(b"k", b"small-%d" % i) for i in range(50)])
        insert_rows(conn, schema, topic, [(b"k", big)])  # refused by the broker, not by the client
        # Enough behind it that the refusal arrives while the batch is still being produced.
        conn.execute(
            f'INSERT INTO "{schema}".outbox (topic, key, value) SELECT %s, %s, '
            "convert_to('after-' || g, 'UTF8') FROM generate_series(0, 19999) g",
            [topic, b"k"],
        )
        conn.commit()
    m = get_metrics()
    aborted = m.txn_aborted._value.get()
    h = Harvester(
        make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=leader, harvester={"transactional_id": _txn_id()})
    ).start()
    try:
        assert wait_until(lambda: m.txn_aborted._value.get() > aborted, 60), "no transaction was aborted"
        assert outbox_count(pg_dsn, schema) >= 20_001  # nothing from the refused record on was purged
        admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
        res = ConfigResource(
            ConfigResource.Type.TOPIC,
            topic,
            incremental_configs=[
                ConfigEntry("max.message.bytes", "100000", incremental_operation=AlterConfigOpType.SET)
            ],
        )
        for f in admin.incremental_alter_configs([res]).values():
            f.result(30)
        assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0, 60), (
            f"{outbox_count(pg_dsn, schema)} rows left after the topic was fixed"
        )
        assert h.publisher.txn_committed > 0
    finally:
        h.stop(10)
    values = _read_all(kafka_bootstrap, topic, expect_at_least=20_051)
    expected = [b"small-%d" % i for i in range(50)] + [big] + [b"after-%d" % i for i in range(20_000)]
    assert values == expected  # one key, so one partition: in order, once each (read_committed)


def test_a_transaction_not_committed_within_the_leadership_is_aborted_and_its_rows_come_again(
    pg_dsn, kafka_bootstrap, schema, topics
):
    topic = topics("data", partitions=PARTITIONS)
    with _paused_leader(pg_dsn, kafka_bootstrap, schema, topic, [b"row-%d" % i for i in range(100)], keys=3) as led:
        pub, store = led.pub, led.store
        pub.strategy.finish(pub.producer, lambda: 0.0)  # the heartbeat deadline has passed: abort, never commit
        assert (pub.txn_committed, pub.txn_aborted) == (0, 1)
        assert led.failures, "no remark was raised for the aborted transaction"
        assert wait_until(lambda: pub.in_flight == 0, 10), pub.in_flight  # every record settled once
        assert outbox_count(pg_dsn, schema) == 100  # and none purged

        # The remark: a new id marks the same rows and publishes them in a new transaction.
        me2 = uuid.uuid4()
        rows2 = store.mark(me2, 500, until=FOREVER)
        assert len(rows2) == 100
        pub.reserve(len(rows2))
        assert pub.produce_rows(rows2, me2, lambda: True, lambda: time.monotonic() + 60) == 100
        assert pub.txn_aborted == 1 and pub.txn_committed == 1
        assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0 and pub.in_flight == 0, 30), (
            outbox_count(pg_dsn, schema),
            pub.in_flight,
        )
        values = _read_all(kafka_bootstrap, topic, expect_at_least=100)
        assert sorted(values) == sorted(b"row-%d" % i for i in range(100))  # the aborted copies stay invisible


def test_an_abort_at_the_deadline_does_not_hold_the_throttle(pg_dsn, kafka_bootstrap, schema, topics, monkeypatch):
    """The harvester with max_in_flight = mark_batch: had the transaction that missed its deadline
    stayed open, its rows would fill the throttle and no further mark (so no further transaction)
    could ever settle it."""
    from support.harness import make_config

    from harvester.units import Harvester

    topic, leader = topics("data", partitions=2), topics("leader", partitions=1)
    with psycopg.connect(pg_dsn) as conn:
        insert_rows(conn, schema, topic, [(b"k%d" % (i % 5), b"v%d" % i) for i in range(300)])
    finish, missed = TransactionalStrategy.finish, []

    def first_misses_its_deadline(self, producer, valid_until):
        if not missed:
            missed.append(True)
            valid_until = lambda: 0.0  # noqa: E731 (a heartbeat late by a hair; NELI does not fence)
        return finish(self, producer, valid_until)

    monkeypatch.setattr(TransactionalStrategy, "finish", first_misses_its_deadline)
    h = Harvester(
        make_config(
            pg_dsn,
            schema,
            kafka_bootstrap,
            leader_topic=leader,
            harvester={"transactional_id": _txn_id(), "max_in_flight": 100, "mark_batch": 100},
        )
    ).start()
    try:
        assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0, 30), (
            outbox_count(pg_dsn, schema),
            h.publisher.in_flight,
            h.publisher.txn_aborted,
        )
        assert missed and h.publisher.txn_aborted >= 1 and h.publisher.txn_committed >= 3
    finally:
        h.stop(5)
    values = _read_all(kafka_bootstrap, topic, expect_at_least=300)
    assert sorted(values) == sorted(b"v%d" % i for i in range(300))


def test_an_abort_raises_the_remark_before_the_next_batch_can_be_produced(pg_dsn, kafka_bootstrap, schema, topics):
    """The failed record's own remark comes from the poll thread and can be late: had the abort
    not raised one itself, the producing thread could go on to commit the next batch marked under
    the same id while the aborted rows before it wait (seen once under CI load)."""
    topic = topics("data", partitions=PARTITIONS)
    with _paused_leader(pg_dsn, kafka_bootstrap, schema, topic, [b"row-%d" % i for i in range(20)], keys=1) as led:
        pub = led.pub
        pub.strategy._failed = True  # as report() sets it, a moment before the settler raises the remark
        pub.strategy.finish(pub.producer, lambda: time.monotonic() + 60)
        assert pub.txn_aborted == 1 and led.failures, "aborted without a remark: the next batch of this id may go out"


class _Recording:
    """A real producer that logs (call, transactional id) for the calls the order rests on."""

    def __init__(self, conf: dict, calls: list, fail_init: set | None = None) -> None:
        self._producer, self._id, self._calls = Producer(conf), conf["transactional.id"], calls
        self._fail_init = fail_init if fail_init is not None else set()

    def __getattr__(self, name):
        return getattr(self._producer, name)

    def __len__(self) -> int:
        return len(self._producer)

    def init_transactions(self, *args):
        self._calls.append(("init", self._id))
        if self._id in self._fail_init:  # once: as a coordinator timing out, or an ACL refusing
            self._fail_init.discard(self._id)
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "injected init failure"))
        return self._producer.init_transactions(*args)

    def begin_transaction(self, *args):
        self._calls.append(("begin", self._id))
        return self._producer.begin_transaction(*args)

    def produce(self, *args, **kwargs):
        self._calls.append(("produce", self._id))
        return self._producer.produce(*args, **kwargs)


def test_transactions_take_the_producers_in_turn_after_fencing_every_one(pg_dsn, kafka_bootstrap, schema, topics):
    """Each transaction goes to the next producer of the set (no 20 ms CONCURRENT_TRANSACTIONS
    retry behind the previous commit's markers); all of them are initialised, which fences an old
    leader on every id, before the first record; per key, a read_committed consumer sees the rows in
    order and once."""
    topic = topics("data", partitions=PARTITIONS)
    calls: list = []
    txn_id = _txn_id()
    conf = producer_config(kafka_bootstrap, {}, {})
    conf["transactional.id"] = txn_id
    with psycopg.connect(pg_dsn) as conn:
        insert_rows(conn, schema, topic, [(b"k%d" % (i % 7), b"%d" % i) for i in range(300)])
    pool = make_pool(pg_dsn, 3)
    store = OutboxStore(pool, schema)
    pub = Publisher(
        conf,
        store,
        get_metrics(),
        purge_workers=1,
        providers=Providers(producer=lambda c: _Recording(c, calls)),
    ).start()
    try:
        me = uuid.uuid4()
        for _ in range(6):
            rows = store.mark(me, 50, until=FOREVER)
            pub.reserve(len(rows))
            assert pub.produce_rows(rows, me, lambda: True, lambda: time.monotonic() + 60) == len(rows)
        assert pub.txn_committed == 6 and pub.txn_aborted == 0
        ids = [txn_id] + [f"{txn_id}#{i}" for i in range(1, TXN_PRODUCERS)]
        first_produce = next(i for i, (call, _) in enumerate(calls) if call == "produce")
        assert sorted(i for call, i in calls[:first_produce] if call == "init") == sorted(ids)
        begun = [i for call, i in calls if call == "begin"]
        assert begun == [ids[k % TXN_PRODUCERS] for k in range(6)]
        values = _read_all(kafka_bootstrap, topic, expect_at_least=300)
        assert sorted(values, key=int) == [b"%d" % i for i in range(300)]
        for k in range(7):  # one key, one partition: consumed in offset order, which must be row order
            mine = [int(v) for v in values if int(v) % 7 == k]
            assert mine == sorted(mine), f"key k{k} went backwards"
    finally:
        pub.close()
        pool.close()


@pytest.mark.parametrize("how", ["second init fails", "leadership blips after the first init"])
def test_nothing_is_begun_until_every_producer_of_the_set_is_initialised(pg_dsn, kafka_bootstrap, schema, topics, how):
    """An old leader may hold an open transaction on any id of the set: until every one of them is
    initialised (fenced), no transaction may begin on any, whatever interrupted the inits."""
    topic = topics("data", partitions=PARTITIONS)
    calls: list = []
    txn_id = _txn_id()
    failing = {f"{txn_id}#1"} if how == "second init fails" else set()
    with psycopg.connect(pg_dsn) as conn:
        insert_rows(conn, schema, topic, [(b"k%d" % (i % 3), b"%d" % i) for i in range(40)])
    pool = make_pool(pg_dsn, 3)
    store = OutboxStore(pool, schema)
    pub = Publisher(
        producer_config(kafka_bootstrap, {}, {}, transactional_id=txn_id),
        store,
        get_metrics(),
        purge_workers=1,
        providers=Providers(producer=lambda c: _Recording(c, calls, failing)),
    ).start()
    try:
        checks = iter([True, False])  # valid when the inits start, gone right after the first one

        def blipping() -> bool:
            return next(checks, True)

        me = uuid.uuid4()
        rows = store.mark(me, 100, until=FOREVER)
        pub.reserve(len(rows))
        if how == "second init fails":
            with pytest.raises(KafkaException):
                pub.produce_rows(rows, me, lambda: True, lambda: time.monotonic() + 60)
        else:
            assert pub.produce_rows(rows, me, blipping, lambda: time.monotonic() + 60) == 0
        expected = [("init", txn_id), ("init", f"{txn_id}#1")] if how == "second init fails" else [("init", txn_id)]
        assert calls == expected  # and nothing begun, nothing produced
        assert not pub.strategy.ready
        me = uuid.uuid4()
        rows = store.mark(me, 100, until=FOREVER)
        pub.reserve(len(rows))
        assert pub.produce_rows(rows, me, lambda: True, lambda: time.monotonic() + 60) == 40
        inits = [i for call, i in calls if call == "init"]
        first_begin = next(n for n, (call, _) in enumerate(calls) if call == "begin")
        assert {i for call, i in calls[:first_begin] if call == "init"} == {txn_id, f"{txn_id}#1"}
        assert inits.count(txn_id) == 1, "an initialised producer was initialised again"
        assert pub.strategy.ready and pub.txn_committed == 1
        values = _read_all(kafka_bootstrap, topic, expect_at_least=40)
        assert sorted(values, key=int) == [b"%d" % i for i in range(40)]
    finally:
        pub.close()
        pool.close()
