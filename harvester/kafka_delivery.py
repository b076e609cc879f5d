"""Produce a handful of records and wait until Kafka has each one, for the paths that must know
before going on: the acker's dead letters (harvester.services.ack_dead_letters) and `reaper acks
requeue` (harvester.admin.acks). Not the publishing path, which never waits record by record."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

Headers = list[tuple[str, str | bytes | None]]
Record = tuple[str, bytes | None, bytes | None, Headers]  # topic, key, value, headers


STILL_QUEUED = "still queued when the wait ended"


def produce_each(producer: Producer, records: Iterable[Record], timeout: float = 30.0) -> dict[int, KafkaError]:
    """Produce every record (waiting for room when the local queue is full), then flush for up to
    `timeout` seconds. Returns the error of each record Kafka does not have, by its index: its
    delivery report's, the produce call's refusal (too large for the producer, say), or
    _MSG_TIMED_OUT (STILL_QUEUED) for one still queued. Empty when Kafka has them all."""
    errors: dict[int, KafkaError] = {}
    reported: set[int] = set()

    def report(n: int) -> Callable[[KafkaError | None, Any], None]:
        def delivered(err: KafkaError | None, _msg: Any) -> None:
            reported.add(n)
            if err is not None:
                errors[n] = err

        return delivered

    count = 0
    for n, (topic, key, value, headers) in enumerate(records):
        count = n + 1
        while True:
            try:
                producer.produce(topic, key=key, value=value, headers=headers, on_delivery=report(n))
                break
            except BufferError:  # the local queue is full: make room
                producer.poll(0.1)
            except KafkaException as exc:  # refused before it was queued
                reported.add(n)
                errors[n] = exc.args[0]
                break
    if producer.flush(timeout):
        for n in range(count):
            if n not in reported:
                errors[n] = KafkaError(KafkaError._MSG_TIMED_OUT, STILL_QUEUED)
    return errors


def produce_all(producer: Producer, records: Iterable[Record], timeout: float = 30.0) -> tuple[int, list[str]]:
    """produce_each, told as how many were still queued and the other errors, both empty when
    Kafka has them all."""
    errors = produce_each(producer, records, timeout).values()
    queued = [e.code() == KafkaError._MSG_TIMED_OUT and e.str() == STILL_QUEUED for e in errors]
    return sum(queued), [str(e) for e, left in zip(errors, queued) if not left]
