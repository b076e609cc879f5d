"""A retired producer's own errors (librdkafka reports records purged in flight under the gap-less
guarantee as a fatal error, an expected consequence of the retirement) neither mark the producer
slot broken nor retire its new producers; a fatal error of a current producer still does.

The producers are real librdkafka clients on the real Kafka; the error is handed to the error
callback each one was configured with, as librdkafka's poll would."""

from __future__ import annotations

from confluent_kafka import KafkaError, Producer

from harvester.publishing.producer_slot import ProducerSlot

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
