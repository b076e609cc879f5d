"""AckProducer never lets a flush() return while acks it was given are missing: a message that
produce() refuses keeps its whole round buffered (sent again by the next send, a duplicate at
most) and raises AckDeliveryError; and a max_message_bytes the client itself would refuse is
refused when the helper is made. Real Kafka; librdkafka's own synchronous refusal."""

from __future__ import annotations

import pytest
from support.harness import read_messages

from tracker.consumer import AckDeliveryError, AckProducer
from tracker.errors import InvalidValue


@pytest.mark.parametrize(
    ("client", "given"),
    [({"message.max.bytes": 20_000}, 1_000_000), ({}, 1_000_000), ({"message.max.bytes": "20000"}, 16_000)],
)
def test_a_message_size_the_client_refuses_is_refused_at_once(kafka_bootstrap, client, given):
    with pytest.raises(InvalidValue, match="max_message_bytes") as refused:
        AckProducer(bootstrap_servers=kafka_bootstrap, topic="acks", kafka_client=client, max_message_bytes=given)
    assert str(given) in str(refused.value)


def test_a_refused_send_keeps_its_round_buffered_until_a_send_gets_through(kafka_bootstrap, topics):
    topic = topics("acks")
    p = AckProducer(
        bootstrap_servers=kafka_bootstrap,
        topic=topic,
        kafka_client={"message.max.bytes": 20_000},
        linger=3600,
        max_message_bytes=15_000,
    )
    p.max_message_bytes = 1_000_000  # past the client's limit (set after the check): produce() refuses
    # every other index of 4 groups: ~16k one-item runs, a ~200 kB message
    ids = [f"7:{g}:{i}" for g in range(4) for i in range(0, 8192, 2)]
    p.ack(ids)
    p.fail("8:0:3", "bad row")
    for _ in range(2):  # a retried flush raises again: nothing was lost meanwhile
        with pytest.raises(AckDeliveryError, match="refused"):
            p.flush(10)
    p.max_message_bytes = 15_000
    p.flush(30)
    messages = read_messages(kafka_bootstrap, topic, 1, 30, linger=2.0)
    entries = {e for m in messages for e in m.value().decode().split(",")}
    assert "!8:0:3" in entries
    acked = {e for e in entries if e.startswith("7:")}
    assert acked == {f"7:{g}:{i}" for g in range(4) for i in range(0, 8192, 2)}, len(acked)
    assert p.acks_sent >= len(ids) and p.failures_sent >= 1


def test_a_call_whose_first_round_is_refused_buffers_its_later_rounds_too(kafka_bootstrap, topics):
    """A call naming more groups than one round holds is buffered round by round; a refused send
    between rounds must not leave the call's later rounds out."""
    topic = topics("acks")
    p = AckProducer(
        bootstrap_servers=kafka_bootstrap,
        topic=topic,
        kafka_client={"message.max.bytes": 20_000},
        linger=3600,
        max_pending=10**9,
        max_message_bytes=15_000,
    )
    p.max_message_bytes = 1_000_000  # every send refused by produce() for now
    ids = [f"7:{g}:0-8191" for g in range(5000)]  # 5,000 whole groups: more than one round
    with pytest.raises(AckDeliveryError):
        p.ack(ids)
    p.max_message_bytes = 15_000
    p.flush(30)
    messages = read_messages(kafka_bootstrap, topic, 1, 30, linger=2.0)
    groups = {e.split(":")[1] for m in messages for e in m.value().decode().split(",")}
    assert len(groups) == 5000, f"{5000 - len(groups)} of 5000 groups' acks were never produced"
