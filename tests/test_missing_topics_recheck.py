"""The producing thread asks about held topics (harvester.publishing.missing_topics): with brokers
that do not answer, one pass stops at its first unanswered question instead of waiting out each
held topic in turn (eight topics held up the thread eight seconds). A real librdkafka producer
aimed at a port where nothing listens."""

from __future__ import annotations

from confluent_kafka import Producer

from harvester.publishing import missing_topics
from harvester.publishing.missing_topics import MissingTopics


class _Counted:
    """A real producer, counting the metadata questions asked through it."""

    def __init__(self, inner: Producer) -> None:
        self.inner, self.asked = inner, 0

    def list_topics(self, topic=None, timeout=-1):
        self.asked += 1
        return self.inner.list_topics(topic, timeout=timeout)


def test_a_pass_with_unanswering_brokers_asks_once_and_leaves_the_rest_for_later(monkeypatch):
    monkeypatch.setattr(missing_topics, "CHECK_EVERY", 0.0)
    monkeypatch.setattr(missing_topics, "METADATA_TIMEOUT", 0.3)
    held = MissingTopics()
    for n in range(8):  # topics the application has not created yet
        held.hold(f"orders-{n}")
    producer = _Counted(Producer({"bootstrap.servers": "127.0.0.1:1", "log_level": 0}))
    assert held.recheck(producer) is None
    assert producer.asked == 1
    assert held.recheck(producer) is None  # the next pass asks again, from the first
    assert producer.asked == 2 and len(held.held) == 8


def test_a_held_topic_that_exists_is_found(kafka_bootstrap, topics, monkeypatch):
    monkeypatch.setattr(missing_topics, "CHECK_EVERY", 0.0)
    present = topics("present")
    held = MissingTopics()
    held.hold("never-created-" + present)
    held.hold(present)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    assert held.recheck(producer) == present
