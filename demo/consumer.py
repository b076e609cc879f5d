"""The example consumer: processes item messages and acks each item through the ack topic.

    python -m demo.consumer BOOTSTRAP ITEM_TOPIC ACK_TOPIC GROUP

Several run in one consumer group. Each polled chunk is processed, its acks are flushed to the
ack topic (tracker.consumer.AckProducer compacts consecutive items into runs, keyed by batch
id), and only then are the consumer's offsets committed: a crash re-delivers, and the re-ack is
harmless because acks are idempotent. Runs until SIGTERM.
"""

from __future__ import annotations

import json
import signal
import sys
import threading

from confluent_kafka import Consumer

from tracker.consumer import AckProducer, item_id_of


def process(value: bytes) -> None:
    item = json.loads(value)  # the "work": a real consumer would call a service, write a row...
    assert "sku" in item


def main(argv: list[str]) -> int:
    bootstrap, item_topic, ack_topic, group = argv
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    consumer = Consumer(
        {
            "log_level": 4,
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "session.timeout.ms": 6000,
            "partition.assignment.strategy": "cooperative-sticky",
        }
    )
    consumer.subscribe([item_topic])
    acks = AckProducer(bootstrap_servers=bootstrap, topic=ack_topic, linger=0.05, kafka_client={"log_level": 4})
    processed = 0
    try:
        while not stop.is_set():
            messages = consumer.consume(5000, timeout=0.2)
            ids = []
            for msg in messages:
                if msg.error():
                    continue
                process(msg.value())
                ids.append(item_id_of(msg))
            if ids:
                acks.ack(ids)
                acks.flush()  # the acks are in Kafka: now the offsets may move on
                consumer.commit(asynchronous=True)
                processed += len(ids)
    finally:
        acks.close()
        consumer.close()
    print(json.dumps({"processed": processed}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
