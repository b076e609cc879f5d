"""Delivery reports by partition run (harvester.publishing.runs): one report settles every record of
a produce call's partition; a failed run is reset whole; a record Kafka refuses is still quarantined."""

from __future__ import annotations

import uuid
import zlib

import psycopg
import pytest
from confluent_kafka import KafkaError, KafkaException, Producer
from hypothesis import given, settings
from hypothesis import strategies as st
from support.harness import outbox_marks, wait_until

from harvester.metrics import get as get_metrics
from harvester.publishing.deliveries import DeliverySettler
from harvester.publishing.idempotent import PRODUCE_RETRIES, PlainStrategy
from harvester.publishing.outbox_sql import FOREVER, OutboxStore, make_pool
from harvester.publishing.producer_slot import ProducerSlot
from harvester.publishing.publisher import producer_config
from tracker.message_ids import Namespace

# Records produced directly: the old id form (<namespace>:<row id>), so a row id reads back from it
NS = Namespace(uuid.UUID(int=0), suffix_from=2**63)
P = NS.prefix

FOREVER_VALID = (lambda: True, lambda: float("inf"))


def _insert(pg_dsn: str, schema: str, rows: list[tuple[str, bytes, int | None]]) -> list[int]:
    with psycopg.connect(pg_dsn) as c:
        return [
            c.execute(
                f'INSERT INTO "{schema}".outbox (topic, key, value, kafka_partition) VALUES (%s, %s, %s, %s) RETURNING id',
                [topic, key, b"v", part],
            ).fetchone()[0]
            for topic, key, part in rows
        ]


class _Wrapped:
    """A real producer whose delivery callbacks pass through `alter(partition, err) -> err`."""

    def __init__(self, inner: Producer, alter) -> None:
        self._inner, self._alter = inner, alter

    def produce(self, topic, value, key, partition, callback, on_delivery, timestamp, headers) -> None:
        if callback is not None:
            inner, alter = callback, self._alter

            def callback(err, msg, _inner=inner):
                _inner(alter(msg.partition(), err), msg)

        self._inner.produce(topic, value, key, partition, callback, on_delivery, timestamp, headers)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)


def _publisher_parts(pg_dsn, schema, kafka_bootstrap, alter=None, producer: dict | None = None):
    """The plain strategy's parts over real Kafka; `alter` wraps the producer's delivery callbacks
    (see _Wrapped), `producer` adds producer settings."""
    pool = make_pool(pg_dsn, 3)
    store = OutboxStore(pool, schema)
    remarks: list[str] = []
    settler = DeliverySettler(store, get_metrics(), workers=1, on_failure=remarks.append)
    conf = producer_config(kafka_bootstrap, {}, producer or {})
    factory = Producer if alter is None else lambda c: _Wrapped(Producer(c), alter)
    slot = ProducerSlot(conf, factory, after_poll=settler.wake_if_pending)
    settler.start()
    slot.start()
    return pool, store, settler, slot, PlainStrategy(slot, settler, store), remarks


def _stop(pool, settler, slot) -> None:
    slot.close()
    settler.stop(10)
    pool.close()


def test_the_default_partitioner_is_crc32_of_the_key_modulo_the_partition_count(kafka_bootstrap, topics):
    """What harvester.publishing.runs computes is what librdkafka chooses for the same key."""
    topic = topics("data", partitions=5)
    producer = Producer(producer_config(kafka_bootstrap, {}, {}))
    chosen: dict[bytes, int] = {}
    for i in range(500):
        producer.produce(
            topic, b"v", b"key-%d" % i, -1, lambda err, msg: chosen.__setitem__(msg.key(), msg.partition())
        )
    assert producer.flush(30) == 0
    assert len(chosen) == 500
    assert {k: zlib.crc32(k) % 5 for k in chosen} == chosen


def test_a_run_whose_last_report_fails_resets_every_row_of_the_run(pg_dsn, kafka_bootstrap, schema, topics):
    """Partition 1's run is reported failed (every record of it was written): all its rows are
    reset, none purged; partition 0's run is purged exactly."""
    topic = topics("data", partitions=2)
    keys = [b"k%d" % i for i in range(40)]
    ids = _insert(pg_dsn, schema, [(topic, k, None) for k in keys])
    on_1 = {i for i, k in zip(ids, keys, strict=True) if zlib.crc32(k) % 2 == 1}
    assert 5 < len(on_1) < 35
    failed = KafkaError(KafkaError._TRANSPORT, "reported failed by the test")
    reports: list[int] = []

    def alter(part: int, err):
        reports.append(part)
        return failed if part == 1 else err

    pool, store, settler, slot, plain, remarks = _publisher_parts(pg_dsn, schema, kafka_bootstrap, alter=alter)
    try:
        me = uuid.uuid4()
        rows = store.mark(me, 100, until=FOREVER)
        settler.reserve(len(rows))
        assert plain.produce_rows(rows, me, *FOREVER_VALID) == len(rows)
        assert settler.drain(30)
        assert outbox_marks(pg_dsn, schema) == {i: None for i in sorted(on_1)}  # reset, not purged
        assert settler.delivered == len(ids) - len(on_1)
        assert remarks, "a failed run raises a remark"
        assert sorted(reports) == [0, 1], "one report per partition run"
    finally:
        _stop(pool, settler, slot)


# ------------------------------------------------------------------ the runs cover every row once


class _Recording:
    """Keeps what each produce() got; refuses the records of `refused` ids as never acceptable."""

    def __init__(self, refused: set[str], partitions: int, fail_at: str, fail_times: int = 10**9) -> None:
        self.records: list[tuple[str, int, object, str]] = []
        self.refused, self.partitions, self.fail_at = refused, partitions, fail_at
        self.fail_times = fail_times  # how often the record `fail_at` is refused before it is taken

    def produce(self, topic, value, key, partition, callback, on_delivery, timestamp, headers) -> None:
        mid = headers[-1][1]
        if mid == self.fail_at and self.fail_times > 0:
            self.fail_times -= 1
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "a passing failure"))
        if mid in self.refused:
            raise KafkaException(KafkaError(KafkaError._INVALID_ARG, "refused by the test"))
        self.records.append((topic, partition, callback, mid))

    def list_topics(self, topic, timeout):
        class Meta:
            error = None
            partitions = dict.fromkeys(range(self.partitions))

        class Cluster:
            topics = {topic: Meta()} if topic != "missing" else {}

        return Cluster()

    def __len__(self) -> int:
        return 0


class _Store:
    def quarantine(self, leader_id, ids, reason) -> int:
        return len(ids)


class _Msg:
    def latency(self) -> float:
        return 0.001


_ROW = st.tuples(
    st.sampled_from(["t1", "t2", "missing"]),
    st.one_of(st.none(), st.just(b""), st.binary(min_size=1, max_size=3)),
    st.one_of(st.none(), st.integers(0, 3)),
    st.booleans(),  # refused at produce()
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_ROW, max_size=60), st.integers(1, 4), st.integers(0, 60))
def test_every_row_is_covered_by_exactly_one_report_or_released(spec, partitions, stop_at):
    """Over any rows (topics, keys, explicit partitions, refusals, a produce error): each row is
    settled once, by one report (its own, or its run's last record's, all on one partition and
    produced last), by quarantine, or released with a remark (its run was cut short)."""
    metrics = get_metrics()
    remarks: list[str] = []
    settler = DeliverySettler(_Store(), metrics, workers=1, on_failure=remarks.append)
    refused = {f"{P}{i}" for i, s in enumerate(spec) if s[3]}
    producer = _Recording(refused, partitions, f"{P}{stop_at}")
    slot = ProducerSlot({}, lambda conf: producer)
    plain = PlainStrategy(slot, settler, _Store())
    rows = [(i, topic, key, b"v", [], [], part, f"{P}{i}") for i, (topic, key, part, _) in enumerate(spec)]
    settler.reserve(len(rows))
    try:
        got = plain.produce_rows(rows, uuid.uuid4(), lambda: True, lambda: float("inf"))
    except KafkaException:
        got = stop_at  # the caller remarks
    assert got == min(stop_at, len(rows))
    produced = [int(r[3][len(P) :]) for r in producer.records]
    where = {int(mid[len(P) :]): (topic, part) for topic, part, _cb, mid in producer.records}
    for topic, part, _cb, mid in producer.records:  # what was computed is what librdkafka would choose
        row = rows[int(mid[len(P) :])]
        if row[6] is None and row[2] and topic != "missing":
            assert part == zlib.crc32(row[2]) % partitions
        elif row[6] is None:
            assert part == -1
    for at, (_t, _p, cb, _mid) in enumerate(producer.records):
        if cb is not None:
            cb(None, _Msg())
            ids = cb.args[0] if cb.func == settler.report_run else [cb.args[0]]
            assert len({where[i] for i in ids}) == 1, "a run spans one partition"
            assert max(produced.index(i) for i in ids) == at, "a run's report is on its last record"
    reported = [r[0] for r in settler.reports]
    quarantined = [i for i in range(got) if spec[i][3]]
    uncovered = [i for i in produced if i not in reported]
    assert sorted(reported + quarantined + uncovered) == list(range(got)), "every row got through once"
    assert len(set(reported)) == len(reported)
    assert settler.in_flight == len(reported), "the rest was released"
    assert bool(remarks) == bool(uncovered)
    assert all(where[i][1] >= 0 for i in uncovered), "only rows of a run whose last record never went"


def test_a_record_retried_after_a_full_queue_goes_to_its_runs_partition(pg_dsn, kafka_bootstrap, schema, topics):
    """The local queue is full (queue.buffering.max.messages=4): a refused record is produced again
    once there is room, to the partition computed for it. The topic grew from 1 to 3 partitions and
    the producer already knows (as librdkafka's own metadata refresh would tell it), while reaper's
    count is still 1: every record of the call belongs to partition 0's run, and sent anywhere else
    the run's report would stand for records it does not follow."""
    from confluent_kafka.admin import AdminClient, NewPartitions
    from support.harness import read_messages

    topic = topics("data", partitions=1)
    pool, store, settler, slot, plain, _remarks = _publisher_parts(
        pg_dsn, schema, kafka_bootstrap, producer={"queue.buffering.max.messages": 4}
    )
    try:
        _insert(pg_dsn, schema, [(topic, b"first", None)])
        me = uuid.uuid4()
        rows = store.mark(me, 100, until=FOREVER)
        settler.reserve(len(rows))
        assert plain.produce_rows(rows, me, *FOREVER_VALID) == 1  # reaper's count: 1 partition
        assert settler.drain(30)
        admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
        admin.create_partitions([NewPartitions(topic, 3)])[topic].result(timeout=30)
        wait_until(lambda: len(slot.current.list_topics(topic, 5).topics[topic].partitions) == 3, 30)
        keys = [b"k%d" % i for i in range(60)]
        assert {zlib.crc32(k) % 3 for k in keys} == {0, 1, 2}
        _insert(pg_dsn, schema, [(topic, k, None) for k in keys])
        rows = store.mark(me, 100, until=FOREVER)
        settler.reserve(len(rows))
        assert plain.produce_rows(rows, me, *FOREVER_VALID) == len(keys)
        assert plain.queue_full_waits > 0, "the queue was full at least once"
        assert settler.drain(30)
        got = read_messages(kafka_bootstrap, topic, len(keys) + 1)
        assert len(got) == len(keys) + 1
        assert {m.partition() for m in got} == {0}, "every record on the partition computed for its run"
    finally:
        _stop(pool, settler, slot)


def test_a_computed_partition_the_producer_does_not_know_is_no_reason_to_quarantine(
    pg_dsn, kafka_bootstrap, schema, topics
):
    """The topic was deleted and created again with fewer partitions (3, then 1), and the producer
    knows, while reaper's count is still 3: a partition reaper computed for a row without
    `kafka_partition` is refused by produce() as unknown. That says the count is stale, not that
    the row is wrong: it is never moved to the dead table, and the count is looked up again (a
    remark) before the row is published."""
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = topics("data", partitions=3)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    pool, store, settler, slot, plain, remarks = _publisher_parts(pg_dsn, schema, kafka_bootstrap)
    try:
        _insert(pg_dsn, schema, [(topic, b"first", None)])
        me = uuid.uuid4()
        rows = store.mark(me, 100, until=FOREVER)
        settler.reserve(len(rows))
        assert plain.produce_rows(rows, me, *FOREVER_VALID) == 1  # reaper's count: 3 partitions
        assert settler.drain(30)
        admin.delete_topics([topic])[topic].result(timeout=30)
        wait_until(lambda: topic not in admin.list_topics(timeout=5).topics, 30)

        def created() -> bool:
            try:
                admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(timeout=30)
            except KafkaException:
                return False  # still being deleted
            return True

        wait_until(created, 60)
        wait_until(lambda: len(slot.current.list_topics(topic, 5).topics[topic].partitions) == 1, 30)
        key = next(b"k%d" % i for i in range(100) if zlib.crc32(b"k%d" % i) % 3 == 2)
        (row_id,) = _insert(pg_dsn, schema, [(topic, key, None)])
        for _ in range(3):
            me = uuid.uuid4()
            rows = store.mark(me, 100, until=FOREVER)
            settler.reserve(len(rows))
            try:
                plain.produce_rows(rows, me, *FOREVER_VALID)
            except KafkaException:
                pass  # the caller remarks
            assert settler.drain(30)
            assert settler.dead_rows == 0, "a good row moved to the dead table"
            if row_id not in outbox_marks(pg_dsn, schema):
                break
        assert row_id not in outbox_marks(pg_dsn, schema), "published once the count was looked up again"
    finally:
        _stop(pool, settler, slot)


@pytest.mark.parametrize("refusals", [1, PRODUCE_RETRIES])
def test_a_passing_produce_refusal_is_tried_again_in_place(refusals):
    """A produce() refusal for a passing reason, in the middle of a partition run: the record is
    produced again at once (nothing after it was enqueued), so the call gets every row through,
    each covered by its run's report, and forces no remark (which would publish the run again)."""
    remarks: list[str] = []
    settler = DeliverySettler(_Store(), get_metrics(), workers=1, on_failure=remarks.append)
    producer = _Recording(set(), 2, f"{P}5", fail_times=refusals)
    plain = PlainStrategy(ProducerSlot({}, lambda conf: producer), settler, _Store())
    rows = [(i, "t1", b"k%d" % i, b"v", [], [], None, f"{P}{i}") for i in range(12)]
    settler.reserve(len(rows))
    assert plain.produce_rows(rows, uuid.uuid4(), lambda: True, lambda: float("inf")) == len(rows)
    assert [int(r[3][len(P) :]) for r in producer.records] == list(range(12))
    assert remarks == []
    covered = []
    for _t, _p, cb, _m in producer.records:
        if cb is not None:
            covered.extend(cb.args[0] if cb.func == settler.report_run else [cb.args[0]])
    assert sorted(covered) == list(range(12))


def test_a_refusal_that_does_not_pass_stops_the_call():
    """Refused more often than PRODUCE_RETRIES: the call stops at that record (the caller remarks)."""
    settler = DeliverySettler(_Store(), get_metrics(), workers=1, on_failure=lambda why: None)
    producer = _Recording(set(), 2, f"{P}5", fail_times=PRODUCE_RETRIES + 1)
    plain = PlainStrategy(ProducerSlot({}, lambda conf: producer), settler, _Store())
    rows = [(i, "t1", b"k%d" % i, b"v", [], [], None, f"{P}{i}") for i in range(12)]
    settler.reserve(len(rows))
    with pytest.raises(KafkaException):
        plain.produce_rows(rows, uuid.uuid4(), lambda: True, lambda: float("inf"))
    assert [int(r[3][len(P) :]) for r in producer.records] == list(range(5))


@pytest.mark.parametrize("fenced", [False, True], ids=["idempotent", "transactional"])
@pytest.mark.parametrize("bad", ["bad topic!", "ümlaut", "..", "x" * 250])
def test_a_row_whose_topic_name_kafka_never_accepts_is_quarantined_and_holds_up_nothing(
    pg_dsn, kafka_bootstrap, schema, topics, bad, fenced
):
    """Written by SQL past the tracker's checks: librdkafka reports most such names as an unknown
    topic, which alone would be retried for ever, every remark publishing nothing behind it."""
    from support.harness import Receiver, make_config, running

    topic = topics("data", partitions=2)
    rows = [(topic, b"k%d" % (i % 3), None) for i in range(10)]
    rows[4] = (bad, b"k1", None)
    ids = _insert(pg_dsn, schema, rows)
    receiver = Receiver(kafka_bootstrap, topic, 2)
    try:
        fencing = {"transactional_id": f"t-{uuid.uuid4().hex[:8]}"} if fenced else {}
        with running(make_config(pg_dsn, schema, kafka_bootstrap, harvester=fencing)) as h:
            assert wait_until(lambda: not outbox_marks(pg_dsn, schema) and len(receiver.values()) >= 9, 60), (
                f"published {len(receiver.values())} of 9, outbox {outbox_marks(pg_dsn, schema)}"
            )
            assert h.error is None
        with psycopg.connect(pg_dsn) as c:
            dead = c.execute(f'SELECT id, topic, reason FROM "{schema}".outbox_dead').fetchall()
        assert [(d[0], d[1]) for d in dead] == [(ids[4], bad)] and dead[0][2].startswith("TOPIC_EXCEPTION"), dead
    finally:
        receiver.close()
