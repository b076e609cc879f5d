"""Streaming acks: a Structured Streaming query over the ack topic, one bulk ack per micro-batch.

Every micro-batch (foreachBatch) of acks alone is acked by `ack_dataframe`: folded per group,
OR-ed, applied in one transaction per partition. A micro-batch holding failures (entries written
'!<id>' under a `failure-reason` header) is applied as the reaper's acker applies a poll: each
Kafka partition's records in one task, in offset order, folded by `tracker.folding.fold_messages`
into each batch's ordered steps of acks and failures, applied by `apply_outcomes` in one
transaction per fold; so an item's first outcome in its partition wins, as with the acker. Offsets
live in the checkpoint; a micro-batch replayed after a failure re-applies its outcomes, which finds
every item already decided and changes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tracker.config import schema_of
from tracker.kafka_waits import with_waits
from tracker.spark.acks import AckTotals, ack_dataframe
from tracker.spark.options import OFFSETS_MAX, optional_count, optional_tasks
from tracker.spark.progress import Progress, dead_lettered, listener, record_input_rows
from tracker.spark.worker import in_task

# Micro-batches as large as this by default: ~3 s of work at ~300k acks/s, ~40 MB of ids spread
# over the tasks; larger ones add latency and executor memory, smaller ones per-batch overhead.
DEFAULT_MAX_OFFSETS_PER_TRIGGER = 1_000_000


@dataclass
class StreamTotals(AckTotals):
    """Running totals of an ack stream. The counts cover every micro-batch; `completed` and
    `rejected` hold the last micro-batch's alone (a stream runs for as long as it is up: lists of
    everything it saw would grow without bound; rejected entries go to the dead-letter topic)."""

    completed_count: int = 0  # batches completed, by every micro-batch
    rejected_count: int = 0  # entries rejected, by every micro-batch
    failed: int = 0  # items failed (from '!' entries under their failure-reason)
    batches: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    progress: Progress = field(default_factory=Progress)  # from the query listener: rows/s, duration, lag

    def add(self, other: AckTotals | dict[str, Any]) -> None:
        values = other if isinstance(other, dict) else vars(other)
        self.acked += values["acked"]
        self.duplicates += values["duplicates"]
        self.completed = list(values["completed"])
        self.rejected = [tuple(r) for r in values["rejected"]]
        self.completed_count += len(self.completed)
        self.rejected_count += len(self.rejected)


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
    Returns the StreamingQuery and running totals (StreamTotals, updated per micro-batch: counts
    of everything, and the last micro-batch's completed batch ids and rejected entries).

    Throughput: `trigger_interval` None starts each micro-batch as soon as the previous ends;
    `max_offsets_per_trigger` bounds a micro-batch in messages (default 1,000,000: as many acks
    when each message is one id, more when messages list several, e.g. AckProducer's; None:
    everything available); `min_partitions` splits the topic's offset ranges over that many
    read-and-fold tasks (default 2x the default parallelism), `partitions` is the number of apply
    transactions per micro-batch (default: the default parallelism); both from 1 to 100,000. A
    count out of range or not an int raises InvalidArgument or InvalidValue before the query
    starts. Progress (rows/s, micro-batch duration, lag behind the topic's end) goes to
    `totals.progress`, Prometheus (reaper_spark_stream_*) and structlog, from a
    StreamingQueryListener.
    """
    # checked before the query starts: a count Spark cannot use would fail every micro-batch
    optional_count("max_offsets_per_trigger", max_offsets_per_trigger, OFFSETS_MAX)
    optional_tasks("partitions", partitions)
    optional_tasks("min_partitions", min_partitions)
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
    if max_offsets_per_trigger is not None:
        reader = reader.option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
    # One batch's acks share a Kafka partition (keyed by batch id): split partitions' offset ranges
    # over several tasks, or one task reads and folds a hot batch's acks alone.
    reader = reader.option("minPartitions", str(min_partitions or 2 * spark.sparkContext.defaultParallelism))
    reader = reader.option("includeHeaders", "true")  # a failure's reason is in its record's header
    # binary: bad bytes are dead-lettered, never decoded
    stream = reader.load().selectExpr("value AS ack", "key", "partition", "offset", "headers")
    # kafka_options are the Java consumer's (Spark's source); the dead-letter producer is librdkafka's
    # (a silent broker given up after 15 s, not 30-60 s: tracker.kafka_waits)
    producer_conf = {
        "bootstrap.servers": bootstrap_servers,
        "enable.idempotence": True,
        **with_waits(dead_letter_client or {}, producer=True),
    }

    label = query_name or topic
    each = _micro_batch(
        totals,
        dsn=dsn,
        schema=s,
        topic=topic,
        label=label,
        partitions=partitions,
        dead_letter_topic=dead_letter_topic,
        producer_conf=producer_conf,
        after_apply=after_apply,
    )
    writer = stream.writeStream.foreachBatch(each).option("checkpointLocation", checkpoint_location)
    if trigger_interval:
        writer = writer.trigger(processingTime=trigger_interval)
    if query_name:
        writer = writer.queryName(query_name)
    query_id: list[str] = []
    spark.streams.addListener(listener(query_id, label, totals.progress))
    query = writer.start()
    query_id.append(str(query.id))
    return query, totals


def _micro_batch(
    totals: StreamTotals,
    *,
    dsn: str,
    schema: str,
    topic: str,
    label: str,
    partitions: int | None,
    dead_letter_topic: str | None,
    producer_conf: dict,
    after_apply: Callable[[int, int], None] | None,
) -> Callable[[Any, int], None]:
    """The foreachBatch function: applies one micro-batch of the ack topic and adds it to `totals`."""

    def each(batch_df: Any, epoch_id: int) -> None:
        batch_df.persist()
        try:
            # Counted here, all of it read into the cache at once: Spark's own numInputRows counts
            # only what the micro-batch's last job read from Kafka, not what earlier jobs cached.
            # Recorded once the micro-batch is done: a failed one is read again from the checkpoint.
            rows, failures = _count_and_failures(batch_df)
            if failures:
                ordered = ordered_outcomes(batch_df, dsn=dsn, schema=schema, after_apply=after_apply)
                letters = ordered.letters
                result: AckTotals = ordered
            else:
                result = ack_dataframe(
                    batch_df, dsn=dsn, schema=schema, column="ack", partitions=partitions, after_apply=after_apply
                )
                letters = [(entry, why, None) for entry, why in result.rejected]
        finally:
            batch_df.unpersist()
        if letters and dead_letter_topic:
            _dead_letter(producer_conf, dead_letter_topic, topic, letters)
        record_input_rows(totals.progress, label, rows)
        with totals.lock:
            totals.add(result)
            totals.failed += getattr(result, "failed", 0)
            totals.batches += 1

    return each


def _count_and_failures(batch_df: Any) -> tuple[int, bool]:
    """The micro-batch's records, and whether any holds a '!' (a failure entry, or a bad value that
    the ordered path dead-letters just as the ack path would): one job over the micro-batch, where
    a count and then a look for a '!' were two (each a few tasks per Kafka partition range)."""
    from pyspark.sql import functions as f

    row = batch_df.agg(f.count(f.lit(1)), f.max(f.instr(f.col("ack").cast("string"), "!"))).first()
    return int(row[0]), bool(row[1])


@dataclass
class OrderedTotals(AckTotals):
    failed: int = 0
    # (entry as written, why it was set aside, its failure-reason header as received or None)
    letters: list[tuple[str, str, bytes | None]] = field(default_factory=list)


class _Record:
    """A record of Spark's Kafka source, read as `fold_messages` reads a consumed message."""

    __slots__ = ("_partition", "_offset", "_key", "_value", "_headers")

    def __init__(self, row: Any) -> None:
        self._partition, self._offset = row.partition, row.offset
        self._key = None if row.key is None else bytes(row.key)
        self._value = None if row.ack is None else bytes(row.ack)
        headers = row.headers
        self._headers = [(h.key, None if h.value is None else bytes(h.value)) for h in headers] if headers else None

    def error(self) -> None:
        return None

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def headers(self) -> list[tuple[str, bytes | None]] | None:
        return self._headers


# Records one ordered task folds at a time (each fold then holds at most GROUPS_PER_FOLD_MAX groups).
RECORDS_PER_FOLD = 100_000


def _ordered_partition(
    dsn: str, schema: str, after_apply: Callable[[int, int], None] | None = None
) -> Callable[[Iterator[Any]], Iterator[dict]]:
    def apply(rows: Iterator[Any]) -> Iterator[dict]:
        import psycopg
        from pyspark import TaskContext

        from tracker.folding import FAIL_MARK, fold_messages
        from tracker.sync import apply_outcomes

        letters: list[tuple[str, str, bytes | None]] = []
        result: dict[str, Any] = {"acked": 0, "failed": 0, "duplicates": 0, "completed": [], "rejected": []}
        conn: psycopg.Connection | None = None

        def fold_and_apply(records: list[_Record]) -> None:
            nonlocal conn
            rest: list[Any] = records
            while rest:
                folded = fold_messages(rest)
                for n, (_key, value, why, _partition, _offset) in enumerate(folded.bad):
                    written = (value or b"").decode("ascii", "replace")
                    letters.append((written, why, folded.bad_failure.get(n)))
                if any(masks for _r, masks in folded.steps):
                    if conn is None:
                        conn = psycopg.connect(dsn, autocommit=True, application_name="tracker.spark ack stream")
                    with conn.transaction():  # a fold's steps in order, all or none
                        applied = apply_outcomes(conn, folded.steps, reject_invalid=True, schema=schema)
                    for (reason, _masks), r in zip(folded.steps, applied):
                        result["acked" if reason is None else "failed"] += r.acked
                        result["duplicates"] += r.duplicates
                        result["completed"] += r.completed
                        for entry, why in r.rejected:
                            if reason is None:
                                letters.append((entry, why, None))
                            else:
                                letters.append((FAIL_MARK + entry, why, reason.encode()))
                rest = folded.rest

        try:
            records: list[_Record] = []
            for row in rows:
                records.append(_Record(row))
                if len(records) >= RECORDS_PER_FOLD:
                    fold_and_apply(records)
                    records = []
            fold_and_apply(records)
        finally:
            if conn is not None:
                conn.close()
        if conn is not None and after_apply is not None:
            ctx = TaskContext.get()
            assert ctx is not None  # inside a Spark task
            after_apply(ctx.partitionId(), ctx.attemptNumber())
        result["rejected"] = [(entry, why) for entry, why, _failure in letters]
        result["letters"] = letters
        yield result

    return apply


def ordered_outcomes(
    df: Any, *, dsn: str, schema: str | None = None, after_apply: Callable[[int, int], None] | None = None
) -> OrderedTotals:
    """Apply records of the ack topic (columns `ack` (the value), `key`, `partition`, `offset`,
    `headers`, as Spark's Kafka source gives them with includeHeaders) as the reaper's acker
    does: each Kafka partition's records in one task, in offset order, acks and failures (under
    their `failure-reason`) folded into each batch's ordered steps, one transaction per fold. Bad
    and rejected entries come back in `.letters` as they would be dead-lettered."""
    s = schema_of(schema)
    ordered = df.select("ack", "key", "partition", "offset", "headers")
    n = max(1, ordered.select("partition").distinct().count())
    results = (
        ordered.repartition(n, "partition")
        .sortWithinPartitions("partition", "offset")
        .rdd.mapPartitions(in_task(_ordered_partition(dsn, s, after_apply)))
        .collect()
    )
    totals = OrderedTotals()
    for r in results:
        totals.add(r)
        totals.failed += r["failed"]
        totals.letters.extend((entry, why, failure) for entry, why, failure in r["letters"])
    return totals


def _dead_letter(
    conf: dict, dead_letter_topic: str, source_topic: str, letters: list[tuple[str, str, bytes | None]]
) -> None:
    from confluent_kafka import Producer

    producer = Producer(conf)
    for entry, reason, failure in letters:
        key = entry.lstrip("!").split(":", 1)[0].encode() if entry else None
        headers: list[tuple[str, str | bytes | None]] = [
            ("reason", reason.encode()),
            ("source-topic", source_topic.encode()),
        ]
        if failure is not None:  # sent again to the ack topic, it fails under the same reason
            headers.append(("failure-reason", failure))
        producer.produce(dead_letter_topic, key=key, value=entry.encode(), headers=headers)
    left = producer.flush(60)
    if left:
        raise RuntimeError(f"{left} dead letters were not delivered to {dead_letter_topic}")
    dead_lettered.inc(len(letters))
