"""Produce a handful of records and wait until Kafka has each one, for the paths that must know
before going on: the acker's dead letters (harvester.services.ack_dead_letters) and `reaper acks
requeue` (harvester.admin.acks). Not the publishing path, which never waits record by record."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from confluent_kafka import KafkaError, Producer

Headers = list[tuple[str, str | bytes | None]]
Record = tuple[str, bytes | None, bytes | None, Headers]  # topic, key, value, headers


def produce_all(producer: Producer, records: Iterable[Record], timeout: float = 30.0) -> tuple[int, list[str]]:
    """Produce every record (waiting for room when the local queue is full), then flush for up to
    `timeout` seconds. Returns how many were still queued and the delivery errors, both empty
    when Kafka has them all."""
    failures: list[str] = []

    def delivered(err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            failures.append(str(err))

    for topic, key, value, headers in records:
        while True:
            try:
                producer.produce(topic, key=key, value=value, headers=headers, on_delivery=delivered)
                break
            except BufferError:
                producer.poll(0.1)
    return producer.flush(timeout), failures
