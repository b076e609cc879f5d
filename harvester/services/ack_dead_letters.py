"""The acker's dead letters (step 4 of its loop, harvester.services.acker): ack entries it could
not fold (malformed, too large) or the database rejected (unknown batch or group, index out of
range, batch expired), produced to the dead-letter topic before the acker commits its offsets.

Each letter is a message that could be sent to the ack topic again (a failure keeps its '!' and
its failure-reason header), with the reason it was set aside in the `reason` header and the topic
it came from in `source-topic` (every schema's acker shares the dead-letter topic; `reaper acks
requeue` reads both, harvester.admin.acks).
"""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException, Producer

from harvester.kafka_delivery import Headers, produce_all
from tracker.folding import FAIL_MARK, FAILURE_REASON_HEADER, Folded

REASON_HEADER = "reason"

Letter = tuple[bytes | None, bytes | None, Headers]  # key, value, headers


def letters_of(source_topic: str, folded: Folded, rejected: list[tuple[str, str, str | None]]) -> list[Letter]:
    """The letters for a fold's bad entries and the entries the database rejected (entry, why,
    failure reason or None for an ack), in that order."""
    letters: list[Letter] = []
    source = source_topic.encode()
    for n, (key, entry, reason, partition, offset) in enumerate(folded.bad):
        headers: Headers = [
            (REASON_HEADER, reason.encode()),
            ("source-topic", source),
            ("source-partition", str(partition).encode()),
            ("source-offset", str(offset).encode()),
        ]
        failure = folded.bad_failure.get(n)
        if failure is not None:
            headers.append((FAILURE_REASON_HEADER, failure))
        letters.append((key, entry, headers))
    for entry_text, reason, failure_reason in rejected:
        batch_id = entry_text.split(":", 1)[0].encode()
        headers = [(REASON_HEADER, reason.encode()), ("source-topic", source)]
        if failure_reason is not None:
            headers.append((FAILURE_REASON_HEADER, failure_reason.encode()))
            entry_text = FAIL_MARK + entry_text
        letters.append((batch_id, entry_text.encode(), headers))
    return letters


def deliver(producer: Producer, topic: str, letters: list[Letter]) -> None:
    """Produce the letters to `topic` and wait until Kafka has every one; raise KafkaException if
    any was not delivered (the acker then retries the whole poll)."""
    left, failures = produce_all(producer, ((topic, key, value, headers) for key, value, headers in letters))
    if left or failures:
        raise KafkaException(
            KafkaError(
                KafkaError._MSG_TIMED_OUT if left else KafkaError._FAIL,
                f"dead letters not delivered: {left} queued, failures {failures[:3]}",
            )
        )
