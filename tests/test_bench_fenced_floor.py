"""The owned-partitions floor (bench/fenced_floor.py `owned`) measures what it says: every record
committed once, each partition written by the one producer that owns it, in due order."""

from __future__ import annotations

import uuid
import zlib

from confluent_kafka import Consumer

from bench.fenced_floor import _record, owned


def test_owners_commit_every_record_once_in_its_own_partition_in_order(kafka_bootstrap, topics):
    topic = topics("owned", partitions=8)
    result = owned(kafka_bootstrap, topic, 8, 1.0, 2000.0, owners=3)
    assert result["records"] == 2000 and result["p99_ms"] > 0 and result["transactions"] >= 3, result
    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"g-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
        }
    )
    consumer.subscribe([topic])
    seen: dict[int, list[int]] = {}
    eof: set[int] = set()
    try:
        while len(eof) < 8:
            msg = consumer.poll(30)
            assert msg is not None, f"nothing more after {sum(map(len, seen.values()))} records"
            if msg.error():
                eof.add(msg.partition())
                continue
            record = int(dict(msg.headers())["message-id"].split(b":")[1])
            if record >= 0:  # -1: the warm-up transaction of each producer
                assert msg.partition() == zlib.crc32(_record(record)[0]) % 8
                seen.setdefault(msg.partition(), []).append(record)
    finally:
        consumer.close()
    records = [r for rs in seen.values() for r in rs]
    assert sorted(records) == list(range(2000)), "a record missing or committed twice"
    assert all(rs == sorted(rs) for rs in seen.values()), "a partition's records out of due order"
