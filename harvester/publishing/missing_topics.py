"""Topics that do not exist (yet): their rows are held back, in order, while other topics' rows go on.

On brokers that do not create topics, librdkafka first queues a record for a topic it does not
know (up to `topic.metadata.propagation.max.ms`), then fails it in its delivery report; once it
has learnt that the topic does not exist, produce() refuses the topic's records at once
(`_UNKNOWN_TOPIC`), and in a transaction the broker fails them (`UNKNOWN_TOPIC_OR_PART`), aborting
the transaction. Either way the oldest row, remarked from the head again and again, held up every
row behind it, of every topic, for as long as the topic was missing.

Now the first such refusal or report holds the topic (`hold`): its rows are not handed over, under
this leader id or the next ones, so none of them overtakes another (order is per key within a
topic); they stay marked, and rows of other topics are produced as usual. Every CHECK_EVERY
seconds the producing thread asks the brokers for a held topic's metadata (`recheck`); once it
exists, the strategy forces a remark, and the topic is let go when the next leader id starts
(`for_leader`), which marks from the head: the held rows first, in order. A topic held for a
passing error is let go the same way, at the next check.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from typing import Protocol

from confluent_kafka import KafkaError

from harvester import logs
from tracker import is_topic_name

CHECK_EVERY = 5.0  # seconds between questions about a held topic's existence
METADATA_TIMEOUT = 1.0  # how long one pass of questions may hold up the producing thread
SEEN_FOR = 10.0  # seconds a topic found to exist (screen) is taken to exist without asking again


class Metadata(Protocol):
    """What `recheck` uses of confluent_kafka.Producer."""

    def list_topics(self, topic: str | None = ..., timeout: float = ...) -> object: ...


class MissingTopics:
    """Shared by the producing thread and the thread serving delivery reports (a lock guards it)."""

    def __init__(self) -> None:
        self.held: dict[str, float] = {}  # topic -> when its existence is next asked
        self._found: set[str] = set()  # held topics that exist now: let go at the next leader id
        self._leader: uuid.UUID | None = None
        self.reserved: dict[str, KafkaError] = {}  # topic -> why no outbox row may name it
        self._lock = threading.Lock()
        self._log = logs.get("reaper.publish")
        self._lines = logs.Repeats(30.0)
        self._seen: dict[str, float] = {}  # topic -> until when it is taken to exist (screen)
        self._screen_after = 0.0  # after a failed screen() request, none again until then

    def reserve(self, topics: dict[str, KafkaError]) -> None:
        """Topics no outbox row may name, each with the error its rows are quarantined with (the
        reaper reads them itself; Kafka keeps them for itself): kept among the held ones, so the
        produce loop's one lookup finds them too, and never asked about (see `reserved`)."""
        self.reserved = dict(topics)
        with self._lock:
            for topic in topics:
                self.held[topic] = math.inf

    def for_leader(self, leader_id: uuid.UUID) -> None:
        """A new leader id marks from the head: the topics found to exist are let go."""
        if leader_id != self._leader:
            self._leader = leader_id
            if self._found:
                with self._lock:
                    for topic in self._found:
                        self.held.pop(topic, None)
                    self._found.clear()

    def hold(self, topic: str, row_id: int | None = None) -> None:
        with self._lock:
            new = topic not in self.held
            if new:
                self.held[topic] = time.monotonic() + CHECK_EVERY
            self._found.discard(topic)
        if new and self._lines.due(topic):
            self._log.warning(
                "topic does not exist: its rows wait, in order, until it is created; other topics' rows go on",
                topic=topic,
                row_id=row_id,
            )

    def recheck(self, producer: Metadata) -> str | None:
        """A held topic that exists now (the caller has its rows marked again, from the head), or None."""
        now = time.monotonic()
        with self._lock:
            due = [t for t, at in self.held.items() if now >= at and t not in self._found]
            for topic in due:
                self.held[topic] = now + CHECK_EVERY
        ends = now + METADATA_TIMEOUT  # one pass holds up the producing thread this long at most
        for topic in due:
            left = ends - time.monotonic()
            if left <= 0:
                break  # the rest are asked at their next turn
            try:
                meta = producer.list_topics(topic, timeout=left)
            except Exception:  # brokers away: the others would wait as long; asked again later
                break
            found = getattr(meta, "topics", {}).get(topic)
            if found is not None and getattr(found, "error", None) is None and getattr(found, "partitions", None):
                with self._lock:
                    self._found.add(topic)
                self._log.info("topic exists now: its held rows are published", topic=topic)
                return topic
        return None

    def screen(self, producer: Metadata, topics: set[str]) -> None:
        """Hold the topics of `topics` that do not exist (transactional publishing: there librdkafka
        would keep a record for a topic it does not know up to `topic.metadata.propagation.max.ms`,
        and the whole transaction, every topic's rows, with it). Asked of the brokers only for the
        topics not seen lately: one topic alone, several in one request for the whole cluster,
        whose every topic is then taken as seen. A name Kafka can never accept is left to produce()
        (refused at once, quarantined). A failed request holds nothing, and is not made again for
        CHECK_EVERY seconds."""
        now = time.monotonic()
        seen, held = self._seen, self.held
        if now < self._screen_after:
            return
        unsure = [t for t in topics if t not in held and seen.get(t, 0.0) <= now and is_topic_name(t)]
        if not unsure:
            return
        try:
            if len(unsure) == 1:
                known = getattr(producer.list_topics(unsure[0], timeout=METADATA_TIMEOUT), "topics", {})
            else:
                known = getattr(producer.list_topics(timeout=METADATA_TIMEOUT), "topics", {})
        except Exception:  # brokers away, or slow to answer: produced as before; a refusal still holds
            self._screen_after = now + CHECK_EVERY
            return
        for topic, found in known.items():
            if getattr(found, "error", None) is None and getattr(found, "partitions", None):
                seen[topic] = now + SEEN_FOR
        for topic in unsure:
            if seen.get(topic, 0.0) <= now:
                self.hold(topic)
        if len(seen) > 100_000:  # a cluster of very many topics: those of long ago are asked again
            for topic in [t for t, until in seen.items() if until <= now]:
                del seen[topic]
