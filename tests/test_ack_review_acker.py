"""Review fixes on the acker: an oversized bad ack is dead-lettered cut down (never a wedge), the
deferred acks' rejections are dead-lettered, and the pause follows every assignment change."""

from __future__ import annotations

import time
import uuid

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from support.acking import batch_state, closed_batch, committed, end_offsets, make_acker, running
from support.harness import wait_for

from harvester.services.ack_offsets import lag


def _produce(bootstrap, topic, triples):
    p = Producer({"bootstrap.servers": bootstrap})
    for partition, key, value in triples:
        p.produce(topic, key=key, value=value, partition=partition)
    assert p.flush(30) == 0


def _letters(bootstrap, topic, n, timeout=30.0):
    c = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"rv-{uuid.uuid4().hex[:6]}", "auto.offset.reset": "earliest"}
    )
    c.subscribe([topic])
    out, end = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        m = c.poll(0.2)
        if m is not None and m.error() is None:
            out.append(m)
    c.close()
    return out


def test_an_oversized_bad_ack_is_dead_lettered_cut_down_and_the_acker_moves_on(pg_dsn, schema, kafka_bootstrap, topics):
    topic, dlq = topics("acks"), topics("dlq")
    b, (h,) = closed_batch(pg_dsn, schema, 3)
    big = b"\xff" * 999_950  # not ASCII: dead-lettered whole, which with its headers is over the size limit
    _produce(kafka_bootstrap, topic, [(0, b"x", big)] + [(0, str(b.id).encode(), i.encode()) for i in h.item_ids])
    acker = make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq, retry_backoff=0.2, max_poll_records=2)
    with running(acker):
        wait_for(lambda: committed(kafka_bootstrap, acker.group, topic, 1) == [4], timeout=60, what="offsets past it")
    assert batch_state(pg_dsn, schema, b.id) == ("complete", 0)
    assert acker.stats["dead_letters_truncated"] == 1 and acker.stats["dead_letters_dropped"] == 0
    (letter,) = _letters(kafka_bootstrap, dlq, 1)
    headers = dict(letter.headers())
    assert letter.value() == big[:1024] and letter.key() == b"x"
    assert headers["truncated"] == b"value" and headers["original-size"] == b"999950"
    assert (headers["source-topic"], headers["source-partition"], headers["source-offset"]) == (
        topic.encode(),
        b"0",
        b"0",
    )


def _fatal_first(made: list[Producer]) -> type[Producer]:
    """A real Producer class whose first instance is broken for good: a fatal error, as librdkafka
    tells it (error_cb, then _FATAL from produce()); later instances are real and work."""

    class FatalFirst(Producer):
        def __init__(self, conf: dict) -> None:
            super().__init__(conf)
            self.error_cb, self.broken = conf.get("error_cb"), not made
            made.append(self)

        def produce(self, *args, **kwargs):
            if self.broken:
                if self.error_cb is not None:
                    self.error_cb(KafkaError(KafkaError._FATAL, "idempotence state lost", fatal=True))
                raise KafkaException(KafkaError(KafkaError._FATAL, "fatal error", fatal=True))
            return super().produce(*args, **kwargs)

    return FatalFirst


def test_a_dead_letter_producer_broken_for_good_is_replaced_and_the_letters_go_out(
    pg_dsn, schema, kafka_bootstrap, topics, monkeypatch
):
    """A fatal error leaves an idempotent producer refusing every record. That boundary is
    simulated on the first producer (a real one otherwise); the acker replaces it, and the rewound
    poll's letter goes out through the new, real producer."""
    import harvester.services.acker as acker_module

    made: list[Producer] = []
    monkeypatch.setattr(acker_module, "Producer", _fatal_first(made))
    topic, dlq = topics("acks"), topics("dlq")
    b, (h,) = closed_batch(pg_dsn, schema, 1)
    _produce(kafka_bootstrap, topic, [(0, b"x", b"not an ack"), (0, str(b.id).encode(), h.item_ids[0].encode())])
    acker = make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq, retry_backoff=0.2)
    with running(acker):
        wait_for(lambda: committed(kafka_bootstrap, acker.group, topic, 1) == [2], timeout=60, what="offsets past it")
    assert len(made) == 2 and acker.stats["retries"] >= 1
    assert batch_state(pg_dsn, schema, b.id) == ("complete", 0)
    (letter,) = _letters(kafka_bootstrap, dlq, 1)
    assert letter.value() == b"not an ack"


def test_what_a_poll_applied_is_counted_though_its_dead_letters_failed_and_it_came_again(
    pg_dsn, schema, kafka_bootstrap, topics, monkeypatch
):
    """The poll's transaction commits, then its dead letter fails (the producer broken) and the
    poll is read again: the second time every item is a duplicate. The acks, the failure and the
    completion of the first time are counted all the same, in the stats and the metric."""
    from prometheus_client import REGISTRY

    import harvester.services.acker as acker_module
    from tracker.folding import FAILURE_REASON_HEADER

    made: list[Producer] = []
    monkeypatch.setattr(acker_module, "Producer", _fatal_first(made))
    topic, dlq = topics("acks"), topics("dlq")
    b, _ = closed_batch(pg_dsn, schema, 3)
    p = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    value = f"!{b.id}:0:0,{b.id}:0:1-2,junk".encode()
    p.produce(topic, key=str(b.id).encode(), value=value, headers=[(FAILURE_REASON_HEADER, b"timeout")])
    assert p.flush(30) == 0
    metric = ("reaper_acker_failures_applied_total", {"schema": schema})
    before = REGISTRY.get_sample_value(*metric) or 0.0
    acker = make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq, retry_backoff=0.2)
    with running(acker):
        wait_for(lambda: committed(kafka_bootstrap, acker.group, topic, 1) == [1], timeout=60, what="offsets past it")
    assert len(made) == 2 and acker.stats["retries"] >= 1
    assert batch_state(pg_dsn, schema, b.id) == ("complete", 0)
    counted = {k: acker.stats[k] for k in ("acked", "failed", "completed", "duplicates")}
    assert counted == {"acked": 2, "failed": 1, "completed": 1, "duplicates": 3}, counted
    assert (REGISTRY.get_sample_value(*metric) or 0.0) - before == 1


def test_rejected_deferred_acks_are_dead_lettered(pg_dsn, schema, kafka_bootstrap, topics):
    topic, dlq = topics("acks"), topics("dlq")
    b, _h = closed_batch(pg_dsn, schema, 5)
    bad = [f"{b.id}:0:7", f"{b.id}:9:0"]  # index out of range; unknown group
    with psycopg.connect(pg_dsn) as holder:
        holder.execute(f'SELECT 1 FROM "{schema}".batch WHERE id = %s FOR NO KEY UPDATE', [b.id])
        _produce(kafka_bootstrap, topic, [(0, str(b.id).encode(), e.encode()) for e in bad])
        acker = make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq)
        with running(acker):
            wait_for(lambda: acker.stats["deferred"] >= 1, what="deferral")
            holder.rollback()
            wait_for(lambda: committed(kafka_bootstrap, acker.group, topic, 1) == [2], what="offsets committed")
    assert acker.stats["dead_lettered"] == 2
    assert sorted(m.value() for m in _letters(kafka_bootstrap, dlq, 2)) == sorted(e.encode() for e in bad)


def test_partitions_kept_through_a_rebalance_resume_once_the_deferred_drain(pg_dsn, schema, kafka_bootstrap, topics):
    topic, dlq = topics("acks", partitions=2), topics("dlq")
    held, (hh,) = closed_batch(pg_dsn, schema, 2)
    group = f"rv-acker-{uuid.uuid4().hex[:8]}"
    client = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}
    holder = psycopg.connect(pg_dsn)
    try:  # a failure must not leave the batch row locked: the schema's teardown would wait on it
        holder.execute(f'SELECT 1 FROM "{schema}".batch WHERE id = %s FOR NO KEY UPDATE', [held.id])
        _produce(kafka_bootstrap, topic, [(p, b"k", hh.item_ids[p].encode()) for p in (0, 1)])
        # max_groups=1: the two deferred masks fill a fold and pause A; deferred_retry=10 keeps them
        # deferred across the rebalance
        a = make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq, group=group, max_groups=1, deferred_retry=10,
                       consumer_client=client)  # fmt: skip
        with running(a):
            wait_for(lambda: a._paused and a.stats["deferred"] >= 2, what="A paused")
            # while paused, nothing is fetched: the lag is still read from the broker
            fresh, (fh,) = closed_batch(pg_dsn, schema, 3)
            _produce(kafka_bootstrap, topic, [(0, b"k", i.encode()) for i in fh.item_ids])
            wait_for(lambda: a.lag() >= 3, timeout=10, what="lag of a paused partition")
            holder.rollback()
            holder.close()
            b = make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq, group=group, consumer_client=client)
            with running(b):
                wait_for(lambda: b._consumer is not None and len(b._consumer.assignment()) == 1, timeout=60, what="B's")
                wait_for(lambda: batch_state(pg_dsn, schema, held.id)[0] == "complete", timeout=60, what="held batch")
                (mine,) = [tp.partition for tp in a._consumer.assignment()]
                late, (lh,) = closed_batch(pg_dsn, schema, 3)
                _produce(kafka_bootstrap, topic, [(mine, b"k", i.encode()) for i in lh.item_ids])
                wait_for(lambda: batch_state(pg_dsn, schema, late.id)[0] == "complete", timeout=30, what="A reads on")
                wait_for(lambda: batch_state(pg_dsn, schema, fresh.id)[0] == "complete", timeout=30, what="fresh batch")
    finally:
        holder.close()
    assert end_offsets(kafka_bootstrap, topic, 2) == committed(kafka_bootstrap, group, topic, 2)


def test_a_partition_paused_before_its_first_fetch_lags_from_the_committed_offset_or_its_start(kafka_bootstrap, topics):
    """An acker can pause its assignment before it fetched from every partition (a fold filled by
    the first records): such a partition has no position, and its backlog still counts, from the
    group's committed offset or, with none, from the partition's start (auto.offset.reset=earliest)."""
    topic = topics("acks", partitions=4)
    _produce(
        kafka_bootstrap,
        topic,
        [(0, b"k", b"v")] * 3 + [(1, b"k", b"v")] * 5 + [(2, b"k", b"v")] * 6 + [(3, b"k", b"v")] * 4,
    )
    # partition 2: the group committed 1, and retention then deleted everything before offset 4
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for f in admin.delete_records([TopicPartition(topic, 2, 4)]).values():
        f.result(30)
    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"rv-lag-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    try:
        # partition 3: committed past its end (a topic made anew under the same name, say)
        committed = [TopicPartition(topic, 1, 2), TopicPartition(topic, 2, 1), TopicPartition(topic, 3, 20)]
        consumer.commit(offsets=committed, asynchronous=False)
        assigned = [TopicPartition(topic, p) for p in range(4)]
        consumer.assign(assigned)
        consumer.pause(assigned)
        assert [tp.offset for tp in consumer.position(assigned)] == [-1001] * 4  # never fetched
        # 0: 3 from its start (nothing committed); 1: 5 - 2 committed; 2: 6 - 4, its first; 3: all 4
        wait_for(lambda: lag(consumer, ask_broker=True) == 3 + 3 + 2 + 4, timeout=30, what="unfetched partitions' lag")
    finally:
        consumer.close()


def test_small_dead_letters_refused_with_a_large_one_go_whole_and_only_it_is_cut(kafka_bootstrap, topics):
    """The broker refuses a whole request batch over the topic's limit, the small letters in it too:
    they are sent again as they are (never stamped truncated, so `acks requeue` still takes them)."""
    from harvester.services import ack_dead_letters as dead_letters

    dlq = topics("dlq", config={"max.message.bytes": "20000"})
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 50, "enable.idempotence": True})
    letters = [(b"k1", b"small one", []), (b"k2", b"x" * 50_000, []), (b"k3", b"small two", [])]
    done = dead_letters.deliver(producer, dlq, letters)
    assert (done.sent, done.truncated, done.dropped) == (3, 1, [])
    got = {
        m.key(): (len(m.value()), dict(m.headers() or []).get("truncated")) for m in _letters(kafka_bootstrap, dlq, 3)
    }
    assert got == {b"k1": (9, None), b"k2": (1024, b"value"), b"k3": (9, None)}, got
