"""Streaming acks: a Structured Streaming query over the ack topic, one bulk ack per micro-batch.

Every micro-batch (foreachBatch) is acked by `ack_dataframe`: folded per group, OR-ed, applied in
one transaction per partition. Offsets live in the checkpoint; a micro-batch replayed after a
failure re-applies its acks, which re-clears clear bits and changes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tracker.config import schema_of
from tracker.spark.acks import AckTotals, ack_dataframe
from tracker.spark.progress import Progress, dead_lettered, listener

# Micro-batches as large as this by default: ~3 s of work at ~300k acks/s, ~40 MB of ids spread
# over the tasks; larger ones add latency and executor memory, smaller ones per-batch overhead.
DEFAULT_MAX_OFFSETS_PER_TRIGGER = 1_000_000


@dataclass
class StreamTotals(AckTotals):
    batches: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    progress: Progress = field(default_factory=Progress)  # from the query listener: rows/s, duration, lag


def ack_stream(
    spark: Any,
    *,
    bootstrap_servers: str,
    topic: str,
    dsn: str,
    checkpoint_location: str,
    schema: str | None = None,
    dead_letter_topic: str | None = None,
    kafka_options: dict | None = None,
    dead_letter_client: dict | None = None,
    max_offsets_per_trigger: int | None = DEFAULT_MAX_OFFSETS_PER_TRIGGER,
    trigger_interval: str | None = None,
    partitions: int | None = None,
    min_partitions: int | None = None,
    query_name: str | None = None,
    after_apply: Callable[[int, int], None] | None = None,
) -> tuple[Any, StreamTotals]:
    """Start a Structured Streaming query that acks every micro-batch of the ack topic.

    Needs the spark-sql-kafka-0-10 connector on the session's classpath (deploy/spark/jars.py).
    Offsets live in `checkpoint_location`; a micro-batch replayed after a failure re-applies its
    acks, which changes nothing. Rejected entries go to `dead_letter_topic` (reason header) before
    the micro-batch ends. `kafka_options`: options of Spark's Kafka consumer (without or with the
    `kafka.` prefix); `dead_letter_client`: librdkafka settings of the dead-letter producer.
    Returns the StreamingQuery and running totals (updated per micro-batch).

    Throughput: `trigger_interval` None starts each micro-batch as soon as the previous ends;
    `max_offsets_per_trigger` bounds a micro-batch in messages (default 1,000,000: as many acks
    when each message is one id, more when messages list several, e.g. AckProducer's; None:
    everything available); `min_partitions` splits the topic's offset ranges over that many read-and-fold
    tasks (default 2x the default parallelism), `partitions` is the number of apply transactions
    per micro-batch (default: the default parallelism). Progress (rows/s, micro-batch duration,
    lag behind the topic's end) goes to `totals.progress`, Prometheus (reaper_spark_stream_*)
    and structlog, from a StreamingQueryListener.
    """
    s = schema_of(schema)
    totals = StreamTotals()
    reader = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap_servers)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("failOnDataLoss", "false")
    )
    # ack messages are tiny: fetch more than the 1 MiB per partition default at a time, and take
    # far more than the Java consumer's 500 records per poll (measured on the local cluster, 1M
    # acks: reading and folding them took 15.1 s at 500 per poll, 6.1 s at 10,000)
    options = {
        "max.partition.fetch.bytes": str(8 << 20),
        "max.poll.records": "20000",
        **{k.removeprefix("kafka."): v for k, v in (kafka_options or {}).items()},
    }
    for k, v in options.items():
        reader = reader.option(f"kafka.{k}", v)
    if max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
    # One batch's acks share a Kafka partition (keyed by batch id): split partitions' offset ranges
    # over several tasks, or one task reads and folds a hot batch's acks alone.
    reader = reader.option("minPartitions", str(min_partitions or 2 * spark.sparkContext.defaultParallelism))
    stream = reader.load().selectExpr("value AS ack")  # binary: bad bytes are dead-lettered, never decoded
    # kafka_options are the Java consumer's (Spark's source); the dead-letter producer is librdkafka's
    producer_conf = {"bootstrap.servers": bootstrap_servers, "enable.idempotence": True, **(dead_letter_client or {})}

    def each(batch_df: Any, epoch_id: int) -> None:
        result = ack_dataframe(
            batch_df, dsn=dsn, schema=s, column="ack", partitions=partitions, after_apply=after_apply
        )
        if result.rejected and dead_letter_topic:
            _dead_letter(producer_conf, dead_letter_topic, topic, result.rejected)
        with totals.lock:
            totals.add(result)
            totals.batches += 1

    writer = stream.writeStream.foreachBatch(each).option("checkpointLocation", checkpoint_location)
    if trigger_interval:
        writer = writer.trigger(processingTime=trigger_interval)
    if query_name:
        writer = writer.queryName(query_name)
    query_id: list[str] = []
    spark.streams.addListener(listener(query_id, query_name or topic, totals.progress))
    query = writer.start()
    query_id.append(str(query.id))
    return query, totals


def _dead_letter(conf: dict, dead_letter_topic: str, source_topic: str, rejected: list[tuple[str, str]]) -> None:
    from confluent_kafka import Producer

    producer = Producer(conf)
    for entry, reason in rejected:
        key = entry.split(":", 1)[0].encode() if entry else None
        producer.produce(
            dead_letter_topic,
            key=key,
            value=entry.encode(),
            headers=[("reason", reason.encode()), ("source-topic", source_topic.encode())],
        )
    left = producer.flush(60)
    if left:
        raise RuntimeError(f"{left} dead letters were not delivered to {dead_letter_topic}")
    dead_lettered.inc(len(rejected))
