"""A retired producer's own errors (librdkafka reports records purged in flight under the gap-less
guarantee as a fatal error, an expected consequence of the retirement) neither mark the producer
slot broken nor retire its new producers; a fatal error of a current producer still does.

The producers are real librdkafka clients on the real Kafka; the error is handed to the error
callback each one was configured with, as librdkafka's poll would."""

from __future__ import annotations

import time

from confluent_kafka import KafkaError, Producer
from support.harness import wait_until
from support.json_log import events, json_log
from support.tcp_proxy import KafkaProxy

from harvester.publishing.producer_slot import ProducerSlot
from harvester.publishing.publisher import producer_config

GAPLESS = KafkaError(KafkaError._GAPLESS_GUARANTEE, "purged in flight: gap-less guarantee", fatal=True)


class _Made:
    """The factory: real producers, remembering each one's configuration."""

    def __init__(self) -> None:
        self.confs: list[dict] = []

    def __call__(self, conf: dict) -> Producer:
        self.confs.append(conf)
        return Producer(conf)


def test_a_retired_producers_fatal_error_leaves_the_new_one_alone(kafka_bootstrap):
    made, fatal = _Made(), []
    slot = ProducerSlot({"bootstrap.servers": kafka_bootstrap}, made, on_fatal=fatal.append)
    slot.start()
    slot.used = True
    assert slot.retire("test")
    old_conf, new_conf = made.confs
    old_conf["error_cb"](GAPLESS)
    assert not slot.broken and fatal == [] and slot.retired == 1
    new_conf["error_cb"](GAPLESS)  # the current producer's: that one is broken
    assert slot.broken and fatal == ["fatal producer error"]
    slot.close(1)


def test_a_retired_producer_whose_purged_requests_are_answered_logs_no_error(kafka_bootstrap, topics):
    """Records in flight when their producer is retired, answered afterwards: librdkafka reports
    the purge as a fatal gap-less error from the retired producer's poll. That is expected: no
    warning or error line, and the retired producer still leaves once its reports are served."""
    topic = topics("data", partitions=1)
    proxy = KafkaProxy(kafka_bootstrap)
    conf = producer_config(proxy.address, {}, {})
    with json_log() as out:
        slot = ProducerSlot(conf, Producer)
        slot.start()
        try:
            old = slot.current
            proxy.slow(0.5)  # every request answered, late: the first produce request is in flight a while
            for i in range(2000):
                slot.send(old, (topic, b"v%d" % i, b"k"))
            assert wait_until(lambda: proxy.produced_bytes > 0, 20), "no produce request was sent"
            assert slot.retire("neli follower", routine=True)
            assert wait_until(lambda: old not in slot.retiring, 20), len(old)
            retired = events(out)  # before closing the slot, whose new producer may still be connecting
        finally:
            slot.close(2)
            proxy.close()
    # A handover's retirement pages no one: its cause was logged by the election. (Before it, the
    # producer's start through the slow proxy may warn of its own.)
    at = next(i for i, e in enumerate(retired) if e["event"] == "producer retired and replaced")
    assert retired[at]["level"] == "info"
    loud = [e for e in retired[at:] if e["level"] in ("warning", "error")]
    assert loud == [], loud
    assert any(e["event"] == "retired producer reported an error after its retirement" for e in retired[at:])
    assert not slot.broken


def test_a_fatal_error_the_current_producers_poll_raises_marks_the_slot_broken(kafka_bootstrap, topics):
    """A real fatal error: a record the topic refuses as too large, under the gap-less guarantee,
    fails the idempotent producer for good. confluent-kafka raises that error from poll() (its
    error callback may never be called): the slot is marked broken all the same, so the producer is
    replaced, and not polled for ever while every produce() fails."""
    import os

    small = topics("small", partitions=1, config={"max.message.bytes": "10000"})
    fatal: list[str] = []
    slot = ProducerSlot(producer_config(kafka_bootstrap, {}, {}), Producer, on_fatal=fatal.append)
    slot.start()
    try:
        assert slot.send(slot.current, (small, os.urandom(50_000), b"k"))
        assert wait_until(lambda: slot.broken, 30), "a fatal producer error left the slot unbroken"
        assert fatal == ["fatal producer error"]
        assert slot.replace_if_broken() and not slot.broken and slot.retired == 1
    finally:
        slot.close(1)
