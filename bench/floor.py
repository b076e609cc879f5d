"""What a relay cannot beat: reading the rows and producing them, with nothing else around.

On the same pre-filled outbox as the harvester (bench/harvest_once.py's `prefill`, in a fresh
schema and topic):

  copy      one binary `COPY (SELECT <the row's columns and created_at> ... ORDER BY id)
            TO STDOUT`, every row parsed into Python values (psycopg 3)
  produce   those records with their keys and headers (the message id formatted here, from
            created_at: the harvester's mark has Postgres build it, but the floor stays the same
            yardstick as before), through one producer with the harvester's
            idempotent settings (harvester.publishing.publisher.producer_config), in the
            harvester's positional produce call with a delivery callback per record, then flush:
            every record acknowledged by Kafka

The sequential floor is copy then produce (copy_s + produce_s): a relay that reads, then sends,
then reads again. The overlapped floor is max(copy_s, produce_s): a relay that reads the next rows
while the previous ones are on their way. Deleting the rows is not in either: the harvester does it
on top. The process runs with `reaper run`'s process settings, as the harvester does.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
from confluent_kafka import Producer

from bench.harvest_once import prefilled
from harvester.publishing.publisher import producer_config
from tracker import message_ids
from tracker import schema as schema_mod
from tracker.message_ids import MESSAGE_ID_HEADER

COLUMNS = "id, topic, key, value, header_keys, header_values, kafka_partition, created_at"
# created_at read as Postgres's int8, as the harvester's mark loads it (tracker.message_ids)
TYPES = ["int8", "text", "bytea", "bytea", "text[]", "bytea[]", "int4", "int8"]


def copy_rows(dsn: str, schema: str) -> list[tuple]:
    with psycopg.connect(dsn) as conn:
        with conn.cursor().copy(
            f'COPY (SELECT {COLUMNS} FROM "{schema}".outbox ORDER BY id) TO STDOUT (FORMAT BINARY)'
        ) as cp:
            cp.set_types(TYPES)
            return list(cp.rows())


def produce_rows(producer: Producer, rows: list[tuple], ids: message_ids.Namespace) -> int:
    """Produce every row with its headers and its message id (as the harvester does), wait for every
    acknowledgement; returns how many failed."""
    failed = [0]

    def report(err, msg) -> None:
        if err is not None:
            failed[0] += 1

    prefix, cut, epoch = ids.prefix, ids.suffix_from, message_ids.PG_EPOCH_US
    for i, (_id, topic, key, value, hkeys, hvals, partition, created) in enumerate(rows):
        created += epoch
        args = (
            topic,
            value,
            key,
            -1 if partition is None else partition,
            report,
            None,
            0,
            [
                *zip(hkeys, hvals),
                (MESSAGE_ID_HEADER, f"{prefix}{_id}:{created}" if created >= cut else f"{prefix}{_id}"),
            ],
        )
        while True:
            try:
                producer.produce(*args)
                break
            except BufferError:
                producer.poll(0.01)
        if i & 1023 == 0:
            producer.poll(0)
    if producer.flush(300) != 0:
        raise RuntimeError("records still unacknowledged 300 s after the last produce")
    return failed[0]


def measure(dsn: str, bootstrap: str, rows: int, keys: int = 1000) -> dict[str, Any]:
    with prefilled(dsn, bootstrap, rows, keys, schema_mod.migrate) as (schema, topic, _leader_topic):
        producer = Producer(producer_config(bootstrap, {}, {}))
        producer.list_topics(topic, timeout=30)  # connected, metadata known: as a leader's producer is
        with psycopg.connect(dsn, autocommit=True) as conn:
            ids = message_ids.namespace(conn, schema)
        started = time.perf_counter()
        got = copy_rows(dsn, schema)
        copied = time.perf_counter()
        failed = produce_rows(producer, got, ids)
        produced = time.perf_counter()
        if len(got) != rows or failed:
            raise RuntimeError(f"floor: copied {len(got)} of {rows} rows, {failed} deliveries failed")
    copy_s, produce_s = copied - started, produced - copied
    return {
        "records": rows,
        "copy_s": round(copy_s, 3),
        "produce_s": round(produce_s, 3),
        "copy_per_s": round(rows / copy_s),
        "produce_per_s": round(rows / produce_s),
        "sequential_per_s": round(rows / (copy_s + produce_s)),
        "overlapped_per_s": round(rows / max(copy_s, produce_s)),
    }
