"""MissingTopics.screen (fenced publishing asks about a transaction's topics before it begins): a
topic that does not exist is held; one answer serves the transactions that follow; a slow or
failed answer is not waited for by every transaction; a name Kafka can never accept is left to
produce(), which refuses it at once (and the row is quarantined)."""

from __future__ import annotations

import time
import uuid

from confluent_kafka import KafkaError, KafkaException, Producer

from harvester.publishing.missing_topics import METADATA_TIMEOUT, MissingTopics


class _Counting:
    """A real producer's metadata, counting the requests for the whole cluster and for one topic."""

    def __init__(self, producer: Producer) -> None:
        self.producer, self.whole, self.one = producer, 0, 0

    def list_topics(self, topic=None, timeout=-1):
        if topic is None:
            self.whole += 1
        else:
            self.one += 1
        return self.producer.list_topics(topic, timeout=timeout)


def test_missing_topics_are_held_and_one_answer_serves_the_next_transactions(kafka_bootstrap, topics):
    present = [topics(f"s{i}", partitions=1) for i in range(20)]
    absent = f"absent-{uuid.uuid4().hex[:10]}"
    metadata = _Counting(Producer({"bootstrap.servers": kafka_bootstrap}))
    missing = MissingTopics()
    missing.screen(metadata, {present[0], absent})  # two unsure: the whole cluster, once
    assert set(missing.held) == {absent} and metadata.whole == 1
    for name in present:  # one transaction per topic: all seen in that answer
        missing.screen(metadata, {name})
    assert set(missing.held) == {absent}
    assert (metadata.whole, metadata.one) == (1, 0), (metadata.whole, metadata.one)


def test_a_name_kafka_never_accepts_is_not_held():
    class Never:
        def list_topics(self, topic=None, timeout=-1):
            raise AssertionError("asked about a name Kafka can never accept")

    missing = MissingTopics()
    missing.screen(Never(), {"bad topic!", "x" * 250, "__consumer_offsets"})
    assert missing.held == {}


def test_a_slow_answer_is_not_waited_for_by_every_transaction():
    class Slow:  # what librdkafka does when the answer takes longer than the timeout
        calls = 0

        def list_topics(self, topic=None, timeout=-1):
            self.calls += 1
            time.sleep(timeout)
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT))

    missing, slow = MissingTopics(), Slow()
    for _ in range(5):
        missing.screen(slow, {"orders"})
    assert slow.calls == 1 and missing.held == {}
