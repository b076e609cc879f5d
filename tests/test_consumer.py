"""Consumer helpers against the real Postgres and Kafka: item ids from messages, AckProducer, exactly-once."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from confluent_kafka import Producer
from hypothesis import given, settings
from hypothesis import strategies as st
from support.harness import read_messages
from test_tracker_support import completion_events, invariant_violations

import tracker
from tracker import outbox
from tracker.consumer import AckProducer, MissingItemId, batch_id_of_message, compact, exactly_once, item_id_of, runs_of


def _consume(bootstrap: str, topic: str, n: int, timeout: float = 30.0) -> list:
    # a short extra read shows there is nothing beyond n
    return read_messages(bootstrap, topic, n, timeout, linger=1.0)


def test_item_id_of_reads_the_header_of_a_real_message(kafka_bootstrap, topics, conn, schema):
    batch = tracker.open_batch(conn, schema=schema)
    outbox.enqueue(conn, batch, [b"a", b"b"], topic="work", schema=schema)
    rows = conn.execute(f'SELECT header_keys, header_values FROM "{schema}".outbox ORDER BY id').fetchall()
    topic = topics("items")
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for keys, values in rows:
        p.produce(topic, value=b"x", headers=list(zip(keys, values)))
    p.produce(topic, value=b"no headers")
    p.produce(topic, value=b"bad", headers=[("item-id", b"1:2")])
    assert p.flush(30) == 0
    msgs = _consume(kafka_bootstrap, topic, 4)
    assert [item_id_of(m) for m in msgs[:2]] == [f"{batch.id}:0:0", f"{batch.id}:0:1"]
    assert batch_id_of_message(msgs[0]) == batch.id
    with pytest.raises(MissingItemId, match=rf"{topic}\[0\]@2"):
        item_id_of(msgs[2])
    with pytest.raises(tracker.MalformedItemId, match="'1:2'|b'1:2'"):
        item_id_of(msgs[3])


def test_compact_makes_sorted_inclusive_runs():
    assert compact([5, 3, 4, 9, 1, 3]) == [(1, 1), (3, 5), (9, 9)]
    assert compact([]) == []
    assert compact(range(8192)) == [(0, 8191)]


def test_ack_producer_compacts_runs_keyed_by_batch(kafka_bootstrap, topics):
    topic = topics("acks", partitions=3)
    with AckProducer(bootstrap_servers=kafka_bootstrap, topic=topic, linger=60) as acks:
        acks.ack([f"7:0:{i}" for i in range(100)])
        acks.ack(["7:0:200", "7:0:50", "7:1:3-5", "8:2:0", b"8:2:1"])
        with pytest.raises(tracker.MalformedItemId, match="7:0:x"):
            acks.ack(["7:0:300", "7:0:x"])  # nothing of a bad call is buffered
        with pytest.raises(tracker.MalformedItemId, match="beyond any group"):
            acks.ack(["7:0:9000"])
        assert acks.messages_sent == 0  # still buffered (linger 60 s)
    msgs = _consume(kafka_bootstrap, topic, 2)
    by_key = {m.key(): (m.value().decode(), m.partition()) for m in msgs}
    assert len(msgs) == 2
    assert by_key[b"7"][0] == "7:0:0-99,7:0:200,7:1:3-5"
    assert by_key[b"8"][0] == "8:2:0-1"
    assert acks.acks_sent == 106  # 100 + 1 + 3 + 2 (50 was a duplicate)


def test_ack_producer_splits_long_messages_and_sends_at_max_pending(kafka_bootstrap, topics):
    topic = topics("acks")
    acks = AckProducer(bootstrap_servers=kafka_bootstrap, topic=topic, max_pending=10, max_message_bytes=64, linger=60)
    acks.ack([f"1:0:{i}" for i in range(0, 40, 2)])  # 20 single ids > max_pending: sent now, split by size
    acks.flush()
    msgs = _consume(kafka_bootstrap, topic, 1)
    values = [m.value().decode() for m in msgs]
    assert all(len(v) <= 64 for v in values) and len(values) > 1
    assert ",".join(values).split(",") == [f"1:0:{i}" for i in range(0, 40, 2)]


@pytest.fixture
def effects(conn, schema):
    conn.execute(f'CREATE TABLE "{schema}".effect (item_id text, n int)')
    conn.commit()
    return f'"{schema}".effect'


def test_exactly_once_runs_the_effect_once_and_rolls_back_with_it(pg_dsn, conn, schema, effects):
    batch = tracker.open_batch(conn, schema=schema)
    (h,) = tracker.add_items(conn, batch, 2, schema=schema)
    tracker.close_batch(conn, batch, schema=schema)
    conn.commit()
    item = h.item_ids[0]

    def effect(session):
        session.execute(f"INSERT INTO {effects} VALUES (%s, 1)", [item])
        return "done"

    def failing(session):
        session.execute(f"INSERT INTO {effects} VALUES (%s, 99)", [item])
        raise RuntimeError("side effect failed")

    with pytest.raises(RuntimeError):
        exactly_once(conn, item, failing, schema=schema)
    conn.commit()  # the caller's transaction is still usable; nothing of the failed call remains
    assert conn.execute(f"SELECT count(*) FROM {effects}").fetchone() == (0,)
    assert tracker.status(conn, batch, schema=schema).pending == 2

    first = exactly_once(conn, item, effect, schema=schema)
    conn.commit()
    again = exactly_once(conn, item, effect, schema=schema)
    conn.commit()
    assert (first.first_time, first.value, first.ack.acked) == (True, "done", 1)
    assert (again.first_time, again.value, again.ack.duplicates) == (False, None, 1)
    assert conn.execute(f"SELECT item_id, n FROM {effects}").fetchall() == [(item, 1)]
    with pytest.raises(tracker.MalformedItemId):
        exactly_once(conn, f"{batch.id}:0:0-1", effect, schema=schema)  # a run is not one item


def test_exactly_once_under_concurrent_redelivery(pg_dsn, conn, schema, effects):
    batch = tracker.open_batch(conn, schema=schema)
    (h,) = tracker.add_items(conn, batch, 1, schema=schema)
    tracker.close_batch(conn, batch, schema=schema)
    conn.commit()
    item = h.item_ids[0]
    start = threading.Barrier(4)
    outcomes = []

    def consumer():
        with psycopg.connect(pg_dsn) as c:
            start.wait()
            r = exactly_once(
                c, item, lambda s: s.execute(f"INSERT INTO {effects} VALUES (%s, 1)", [item]), schema=schema
            )
            time.sleep(0.05)  # hold the transaction open a little so the others queue behind it
            c.commit()
            outcomes.append(r.first_time)

    threads = [threading.Thread(target=consumer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes) == [False, False, False, True]
    assert conn.execute(f"SELECT count(*) FROM {effects}").fetchone() == (1,)
    assert tracker.status(conn, batch, schema=schema).state == "complete"
    assert len(completion_events(conn, schema)) == 1
    assert invariant_violations(conn, schema) == []


@given(st.sets(st.integers(0, 8191), max_size=300))
def test_runs_of_a_mask_are_the_compacted_indexes(indexes):
    bits = bytearray(1024)
    for i in indexes:
        bits[i >> 3] |= 0x80 >> (i & 7)
    assert runs_of(bits) == compact(indexes)


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"topic": ""}, tracker.InvalidValue, "topic"),
        ({"topic": "acks\x00"}, tracker.InvalidValue, "topic"),
        ({"topic": "a b"}, tracker.InvalidValue, "topic"),
        ({"topic": 7}, tracker.InvalidArgument, "topic"),
        ({"max_pending": 0}, tracker.InvalidValue, "max_pending"),
        ({"max_pending": True}, tracker.InvalidArgument, "max_pending"),
        ({"max_pending": "1"}, tracker.InvalidArgument, "max_pending"),
        ({"max_message_bytes": 63}, tracker.InvalidValue, "max_message_bytes"),
        ({"linger": -1}, tracker.InvalidValue, "linger"),
        ({"linger": float("nan")}, tracker.InvalidValue, "linger"),
        ({"linger": "1"}, tracker.InvalidArgument, "linger"),
        ({"kafka_client": [("linger.ms", 1)]}, tracker.InvalidArgument, "kafka_client"),
        ({"kafka_client": "linger.ms=1"}, tracker.InvalidArgument, "kafka_client"),
    ],
)
def test_ack_producer_names_a_bad_setting_before_making_a_client(kwargs, error, name):
    # The bootstrap points nowhere: a check that came after making the producer would not matter here
    with pytest.raises(error) as info:
        AckProducer(**{"bootstrap_servers": "127.0.0.1:1", "topic": "acks", **kwargs})
    assert str(info.value).startswith(name)


@pytest.mark.parametrize("given", [None, 5, 1.5, {"1:0:0": True}, bytearray(b"1:0:0"), memoryview(b"1:0:0")])
def test_ack_producer_refuses_an_item_ids_argument_tracker_ack_refuses(kafka_bootstrap, topics, given):
    """One id (str or bytes) or an iterable of them, as tracker.ack takes them: a dict is not taken
    for its keys, nor a bytearray read byte by byte; nothing of the call is buffered."""
    with AckProducer(bootstrap_servers=kafka_bootstrap, topic=topics("acks"), linger=3600) as acks:
        for call in (lambda: acks.ack(given), lambda: acks.fail(given, "why")):
            with pytest.raises(tracker.InvalidArgument) as info:
                call()
            assert str(info.value).startswith("item_ids"), info.value
        assert acks._pending == {} and acks._failing == {}


def test_ack_producer_holds_at_most_one_folds_masks(kafka_bootstrap, topics):
    """Ids in many groups: each group's mask is only as long as its highest index, the buffer is
    sent once it holds as many groups as one fold takes (whatever max_pending and linger say), and
    a call whose masks alone would pass one fold's bound is buffered and sent in rounds; a bad id
    anywhere in it, even past the first round, leaves none of the call buffered."""
    from tracker.folding import GROUPS_PER_FOLD_MAX, MASK_BYTES_MAX

    topic = topics("acks", partitions=1)
    n = GROUPS_PER_FOLD_MAX + 500
    wide = [f"8:{g}:8191" for g in range(MASK_BYTES_MAX // 1024 + 7)]  # past one fold's masks
    with AckProducer(bootstrap_servers=kafka_bootstrap, topic=topic, max_pending=10**9, linger=3600) as acks:
        acks.ack([f"9:{g}:0" for g in range(n)])
        assert len(acks._pending) < GROUPS_PER_FOLD_MAX  # sent at the bound, not held for the hour
        assert all(len(bits) == 1 for bits in acks._pending.values())  # index 0: one byte, not 1 KiB
        held = dict(acks._pending)
        with pytest.raises(tracker.MalformedItemId, match="8:1:x"):
            acks.ack([*wide, "8:1:x"])
        assert acks._pending == held  # nothing of the refused call, not even its first round
        acks.ack(wide)
        assert sum(len(bits) for bits in acks._pending.values()) <= MASK_BYTES_MAX
        acks.ack(["9:0:1"])
        acks.flush()
        assert not acks._pending
    expected = [*(f"9:{g}:0" for g in range(n)), *wide, "9:0:1"]
    got: list[str] = []
    for m in _consume(kafka_bootstrap, topic, 5):
        got.extend(m.value().decode().split(","))
    assert sorted(got) == sorted(expected)  # each once


def test_an_ack_producer_names_a_malformed_id_once_as_written(kafka_bootstrap, topics):
    """Its message said 'malformed item id ...: malformed: malformed item id ...' with the
    expected forms twice; now as fold() says it, naming the entry as the caller wrote it."""
    producer = tracker.AckProducer(bootstrap_servers=kafka_bootstrap, topic=topics("acks"))

    @settings(max_examples=300, deadline=None)
    @given(entry=st.one_of(st.text(max_size=30), st.binary(max_size=30), st.just("garbage"), st.just("1:2")))
    def check(entry) -> None:
        try:
            producer.ack([entry])
        except tracker.MalformedItemId as exc:
            text = str(exc)
            assert text.count("malformed item id") == 1 and text.count("(expected") == 1, text
            assert text.startswith(f"malformed item id {entry!r}"), text
            assert exc.item_id == entry

    try:
        check()
    finally:
        producer.close(10)
