"""Spark: fan a DataFrame out into the outbox, ack a DataFrame of item ids, and a streaming ack job.

Fan-out (`fan_out`): the driver takes a run number of the batch (table spark_fanout_run); each
partition then writes, in ONE Postgres transaction, its groups (ids derived from run, Spark
partition id and chunk, in a range the counter-allocated groups never reach), its messages
(binary COPY) and the batch totals. The group insert is `ON CONFLICT DO NOTHING`: an attempt
that finds its partition's groups already there (a retried or speculative attempt of a
partition some attempt already committed) writes nothing, so the outbox never holds a
partition twice. After the job the driver closes the batch.

Acks (`ack_dataframe`): each partition folds its ids into one mask per group (mapInArrow), the
masks of a group are OR-ed across partitions (reduceByKey, partitioned by batch id), and each
resulting partition applies its masks in one transaction through `tracker.acks.apply_masks`,
exactly as the acker does. `ack_stream` runs that on every micro-batch of the ack topic
(foreachBatch); replays re-clear clear bits, which changes nothing.

Executors connect to Postgres themselves (`dsn`), so the DSN must be reachable from them.
"""
from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import psycopg
from psycopg import sql

from .errors import BatchNotOpen, UnknownBatch
from .ids import GROUP_BITS_MAX, GroupMask
from .config import DEFAULT_OUTBOX_TABLE, DEFAULT_SCHEMA
from .schema import check_identifier

# Group ids of Spark fan-out: flag | run << 40 | partition << 20 | chunk. Counter-allocated
# groups (batch.next_group) count up from 0 and never get near 2**62.
SPARK_GROUP_FLAG = 1 << 62
_RUN_SHIFT, _PARTITION_SHIFT = 40, 20
MAX_RUNS, MAX_PARTITIONS, MAX_CHUNKS = 1 << 22, 1 << 20, 1 << 20


def schema_of(schema: str | None) -> str:
    return DEFAULT_SCHEMA if schema is None else check_identifier(schema, "schema")


def spark_group_id(run: int, partition: int, chunk: int) -> int:
    if not (0 <= run < MAX_RUNS and 0 <= partition < MAX_PARTITIONS and 0 <= chunk < MAX_CHUNKS):
        raise ValueError(f"run {run}, partition {partition}, chunk {chunk} out of range for a Spark group id")
    return SPARK_GROUP_FLAG | run << _RUN_SHIFT | partition << _PARTITION_SHIFT | chunk


def run_group_range(run: int) -> tuple[int, int]:
    """[lo, hi) of the group ids of one fan-out run."""
    lo = spark_group_id(run, 0, 0)
    return lo, lo + (1 << _RUN_SHIFT)


def local_session(master: str = "local[2]", *, jars: str | list[str] | None = None, app_name: str = "tracker",
                  conf: dict[str, str] | None = None) -> Any:
    """A SparkSession on this machine: Python workers use this interpreter (so they can import
    tracker and psycopg), the driver binds to loopback, no UI. `jars`: the Kafka connector's
    jars for `ack_stream` (deploy/spark/jars.py prints them)."""
    import os
    import sys

    from pyspark.sql import SparkSession

    # read by the SparkContext when it starts its Python workers
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    builder = (SparkSession.builder.master(master).appName(app_name)
               .config("spark.pyspark.python", sys.executable).config("spark.pyspark.driver.python", sys.executable)
               .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.ui.enabled", "false"))
    if jars:
        builder = builder.config("spark.jars", jars if isinstance(jars, str) else ",".join(jars))
    for k, v in (conf or {}).items():
        builder = builder.config(k, v)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


# ---------------------------------------------------------------- driver: runs


def begin_run(conn: psycopg.Connection, batch_id: int, *, schema: str | None = None, run_key: str | None = None) -> int:
    """Take the next run number of an open batch (or the run already named `run_key`), committed
    before the job starts. Raises UnknownBatch or BatchNotOpen."""
    s = schema_of(schema)
    with conn.transaction():
        row = conn.execute(sql.SQL("SELECT state FROM {} WHERE id = %s FOR NO KEY UPDATE").format(
            sql.Identifier(s, "batch")), [batch_id]).fetchone()
        if row is None:
            raise UnknownBatch(batch_id)
        if row[0] != "open":
            raise BatchNotOpen(batch_id, row[0])
        # A fan-out is activity: the sweeper must not expire the batch before a partition commits.
        conn.execute(sql.SQL("UPDATE {} SET last_activity_at = clock_timestamp() WHERE id = %s").format(
            sql.Identifier(s, "batch")), [batch_id])
        runs = sql.Identifier(s, "spark_fanout_run")
        if run_key is not None:
            found = conn.execute(sql.SQL("SELECT run FROM {} WHERE batch_id = %s AND run_key = %s").format(runs),
                                 [batch_id, run_key]).fetchone()
            if found is not None:
                return found[0]
        return conn.execute(sql.SQL(
            "INSERT INTO {runs} (batch_id, run, run_key) "
            "SELECT %s, coalesce(max(run) + 1, 0), %s FROM {runs} WHERE batch_id = %s RETURNING run").format(runs=runs),
            [batch_id, run_key, batch_id]).fetchone()[0]


# ---------------------------------------------------------------- executors: one partition's write

_int4 = struct.Struct("!i").pack
_COPY_HEADER = b"PGCOPY\n\xff\r\n\0" + bytes(8)
_NULL = b"\xff\xff\xff\xff"
_INDEX = [str(i).encode() for i in range(GROUP_BITS_MAX)]


def _text_array(elements: list[bytes]) -> bytes:
    body = _int4(1) + _int4(0) + _int4(25) + _int4(len(elements)) + _int4(1)
    body += b"".join(_int4(len(e)) + e for e in elements)
    return _int4(len(body)) + body


@dataclass(frozen=True)
class _PartitionWriter:
    """Pickled to the executors; called by mapInArrow with one partition's Arrow record batches."""

    dsn: str
    schema: str
    outbox_table: str
    batch_id: int
    run: int
    topic: str
    value_col: str
    key_col: str | None
    id_col: str | None
    after_commit: Callable[[int, int], None] | None

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import TaskContext

        ctx = TaskContext.get()
        partition, attempt = ctx.partitionId(), ctx.attemptNumber()
        held = [b for b in batches if b.num_rows]  # Arrow buffers: the partition's rows, compactly
        n = sum(b.num_rows for b in held)
        if n:
            self._write(held, n, partition)
            if self.after_commit is not None:
                self.after_commit(partition, attempt)
        if self.id_col is None:
            yield pa.RecordBatch.from_pydict({"partition": [partition], "items": [n]},
                                             schema=pa.schema([("partition", pa.int32()), ("items", pa.int64())]))
            return
        pos = 0
        for b in held:
            ids = [self._item_id(partition, pos + j) for j in range(b.num_rows)]
            pos += b.num_rows
            yield pa.RecordBatch.from_arrays([*b.columns, pa.array(ids, pa.string())],
                                             names=[*b.schema.names, self.id_col])

    def _item_id(self, partition: int, position: int) -> str:
        chunk, index = divmod(position, GROUP_BITS_MAX)
        return f"{self.batch_id}:{spark_group_id(self.run, partition, chunk)}:{index}"

    def _write(self, held: list[Any], n: int, partition: int) -> None:
        sizes = [GROUP_BITS_MAX] * (n // GROUP_BITS_MAX) + ([n % GROUP_BITS_MAX] if n % GROUP_BITS_MAX else [])
        if len(sizes) > MAX_CHUNKS:
            raise ValueError(f"partition {partition} has {n} rows: at most {MAX_CHUNKS * GROUP_BITS_MAX} per partition")
        group_ids = [spark_group_id(self.run, partition, c) for c in range(len(sizes))]
        s = self.schema
        with psycopg.connect(self.dsn) as conn:  # one transaction: commits at the end of the block
            inserted = conn.execute(sql.SQL(
                "INSERT INTO {} (batch_id, id, size, pending, bits) "
                "SELECT %s, g, sz, sz, repeat('1', sz)::varbit FROM unnest(%s::int8[], %s::int4[]) AS u(g, sz) "
                "ON CONFLICT (batch_id, id) DO NOTHING RETURNING id").format(sql.Identifier(s, "batch_group")),
                [self.batch_id, group_ids, sizes]).fetchall()
            if not inserted:
                return  # an earlier attempt committed this partition: write nothing
            if len(inserted) != len(sizes):
                raise RuntimeError(f"partition {partition} of batch {self.batch_id} run {self.run}: "
                                   f"{len(inserted)} of {len(sizes)} groups were new; its rows changed between attempts")
            self._copy_messages(conn, held, group_ids)
            grown = conn.execute(sql.SQL(
                "UPDATE {} SET total = total + %s, pending = pending + %s, last_activity_at = clock_timestamp() "
                "WHERE id = %s AND state = 'open' RETURNING id").format(sql.Identifier(s, "batch")),
                [n, n, self.batch_id]).fetchone()
            if grown is None:
                state = conn.execute(sql.SQL("SELECT state FROM {} WHERE id = %s").format(
                    sql.Identifier(s, "batch")), [self.batch_id]).fetchone()
                raise BatchNotOpen(self.batch_id, state[0] if state else "gone")

    def _copy_messages(self, conn: psycopg.Connection, held: list[Any], group_ids: list[int]) -> None:
        """Binary COPY of one row per item: (topic, key, value, header_keys, header_values)."""
        batch_bytes = str(self.batch_id).encode()
        head = b"\x00\x05" + _int4(len(self.topic.encode())) + self.topic.encode()
        header_keys = _text_array([b"item-id", b"batch-id"])
        tail = _int4(len(batch_bytes)) + batch_bytes  # header_values[2], the batch id

        def middles(prefix: bytes) -> list[bytes]:
            # header_keys + header_values up to the index digits, by the number of digits (1..4)
            out = [b""]
            for digits in range(1, 5):
                id_len = len(prefix) + digits
                out.append(header_keys + _int4(20 + 4 + id_len + len(tail)) + _int4(1) + _int4(0) + _int4(17)
                           + _int4(2) + _int4(1) + _int4(id_len) + prefix)
            return out

        def rows() -> Iterator[tuple[Any, Any]]:
            for b in held:
                values = b.column(self.value_col).to_pylist()
                keys = b.column(self.key_col).to_pylist() if self.key_col else [None] * len(values)
                yield from zip(values, keys)

        copy_sql = sql.SQL("COPY {} (topic, key, value, header_keys, header_values) FROM STDIN (FORMAT BINARY)").format(
            sql.Identifier(self.schema, self.outbox_table))
        head_no_key = head + _NULL
        with conn.cursor().copy(copy_sql) as copy:
            out = bytearray(_COPY_HEADER)
            index, chunk = GROUP_BITS_MAX, -1
            mid: list[bytes] = []
            for value, key in rows():
                if index == GROUP_BITS_MAX:  # next group
                    chunk += 1
                    index = 0
                    mid = middles(b"%d:%d:" % (self.batch_id, group_ids[chunk]))
                if key is None:
                    out += head_no_key
                else:
                    if isinstance(key, str):
                        key = key.encode()
                    out += head
                    out += _int4(len(key))
                    out += key
                if value is None:
                    out += _NULL
                else:
                    if isinstance(value, str):
                        value = value.encode()
                    out += _int4(len(value))
                    out += value
                digits = _INDEX[index]
                out += mid[len(digits)]
                out += digits
                out += tail
                index += 1
                if len(out) > 1 << 20:
                    copy.write(out)
                    out = bytearray()
            out += b"\xff\xff"
            copy.write(out)


# ---------------------------------------------------------------- driver: fan-out


@dataclass
class FanOutResult:
    batch_id: int
    run: int
    items: int        # rows written by this run (from the database, whatever the attempts did)
    groups: int
    complete: bool    # the batch was closed and is complete (e.g. nothing was written)
    dataframe: Any = None  # with id_col: the input rows plus their item ids, materialised once


def fan_out(df: Any, *, dsn: str, topic: str, schema: str | None = None, batch: Any = None,
            user_key: str | None = None, completion_topic: str | None = None, value_col: str = "value",
            key_col: str | None = None, id_col: str | None = None, run_key: str | None = None,
            close: bool = True, after_commit: Callable[[int, int], None] | None = None) -> FanOutResult:
    """Write one outbox message per row of `df` on `topic` and track the rows in a batch.

    `batch`: a tracker Batch or batch id (open); None opens a new batch (`user_key`,
    `completion_topic`). `value_col`/`key_col`: binary or string columns. With `id_col`, the
    result's `.dataframe` is `df` plus that column of item ids (locally checkpointed, so the job
    runs once). `run_key` makes a re-run of a failed job reuse its run: partitions it already
    wrote are skipped. `close`: close the batch after the job. `after_commit(partition, attempt)`
    runs on the executor after a partition's transaction (instrumentation, failure tests).

    As for any Spark job that writes, a partition must hold the same rows in the same order on
    every attempt (sort or checkpoint a non-deterministic input first): an attempt that finds its
    partition written skips it whole, and one whose row count changed fails instead of writing.
    """
    from pyspark.sql.types import StringType, StructField, StructType

    from .api import close_batch, open_batch
    from .batches import batch_id_of

    if not isinstance(topic, str) or not topic:
        raise ValueError(f"topic must be a non-empty string, got {topic!r}")
    for name in (value_col, key_col):
        if name is not None and name not in df.columns:
            raise ValueError(f"column {name!r} is not in the DataFrame (columns: {df.columns})")
    s = schema_of(schema)
    with psycopg.connect(dsn) as conn:
        if batch is None:
            batch = open_batch(conn, user_key=user_key, completion_topic=completion_topic, schema=s)
            conn.commit()
        batch_id = batch_id_of(batch)
        run = begin_run(conn, batch_id, schema=s, run_key=run_key)
    writer = _PartitionWriter(dsn, s, DEFAULT_OUTBOX_TABLE, batch_id, run, topic, value_col, key_col, id_col,
                              after_commit)
    if df.rdd.getNumPartitions() > MAX_PARTITIONS:
        raise ValueError(f"at most {MAX_PARTITIONS} partitions per fan-out")
    out_df = None
    if id_col is None:
        df.mapInArrow(writer, "partition int, items long").collect()
    else:
        out_schema = StructType([*df.schema.fields, StructField(id_col, StringType(), True)])
        out_df = df.mapInArrow(writer, out_schema).localCheckpoint(eager=True)
    lo, hi = run_group_range(run)
    with psycopg.connect(dsn) as conn:
        groups, items = conn.execute(sql.SQL(
            "SELECT count(*), coalesce(sum(size), 0) FROM {} WHERE batch_id = %s AND id >= %s AND id < %s").format(
            sql.Identifier(s, "batch_group")), [batch_id, lo, hi]).fetchone()
        complete = close_batch(conn, batch_id, schema=s) if close else False
        conn.commit()
    return FanOutResult(batch_id, run, int(items), int(groups), complete, out_df)


# ---------------------------------------------------------------- acks from a DataFrame


def _max_index(bits: bytes) -> int:
    for i in range(len(bits) - 1, -1, -1):
        byte = bits[i]
        if byte:
            return i * 8 + 7 - ((byte & -byte).bit_length() - 1)
    return -1


def _or_masks(a: tuple[bytes, int], b: tuple[bytes, int]) -> tuple[bytes, int]:
    n = max(len(a[0]), len(b[0]))
    merged = (int.from_bytes(a[0].ljust(n, b"\0"), "big") | int.from_bytes(b[0].ljust(n, b"\0"), "big")).to_bytes(n, "big")
    return merged, a[1] + b[1]


# A decimal that fits a bigint without checking its value: up to 18 digits, or 19 below 9.2e18
# (fan-out group ids are >= 2**62, 19 digits). Larger ones take the checked path.
_BIGINT = r"(?:[0-9]{1,18}|[1-8][0-9]{18}|9[01][0-9]{17})"
_SINGLE_ID = rf"^(?P<head>{_BIGINT}:{_BIGINT}):(?P<index>[0-9]{{1,4}})$"


def _fold_single_ids(heads: Any, indexes: Any) -> list[tuple[int, int, bytes, int]]:
    """Vectorised fold of plain item ids split into '<batch>:<group>' heads (Arrow strings) and
    indexes (< GROUP_BITS_MAX): (batch, group, packed mask, ids folded) per group."""
    import numpy as np
    import pyarrow.compute as pc

    encoded = pc.dictionary_encode(heads)
    codes = encoded.indices.to_numpy()
    groups = encoded.dictionary.to_pylist()
    bits = np.zeros((len(groups), GROUP_BITS_MAX), dtype=bool)
    bits[codes, indexes] = True
    packed = np.packbits(bits, axis=1)  # bit order "big": index 0 is the high bit of byte 0, as in varbit
    counts = np.bincount(codes, minlength=len(groups))
    out = []
    for j, head in enumerate(groups):
        batch_id, group_id = head.split(b":" if isinstance(head, bytes) else ":")
        out.append((int(batch_id), int(group_id), packed[j].tobytes(), int(counts[j])))
    return out


def _fold_partition(column: str) -> Callable[[Iterator[Any]], Iterator[Any]]:
    def fold(batches: Iterator[Any]) -> Iterator[Any]:
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        from .acker import EntryFolder

        folder = EntryFolder()
        add = folder.add
        heads: list[Any] = []
        indexes: list[Any] = []
        bad: list[str] = []
        reasons: list[str] = []
        for b in batches:
            values = b.column(column)
            # Plain ids in range take the vectorised path; runs, lists, nulls and bad ones the checked one.
            parts = pc.extract_regex(values, _SINGLE_ID)
            plain = pc.is_valid(parts)
            if pc.any(plain).as_py():
                matched = parts.filter(plain)
                index = pc.cast(matched.field("index"), pa.int64())
                ok = pc.less(index, GROUP_BITS_MAX)
                heads.append(matched.field("head").filter(ok))
                indexes.append(index.filter(ok).to_numpy())
                rest = values.filter(pc.invert(plain))
                if not pc.all(ok).as_py():  # out of range: the checked path names them
                    rest = pa.concat_arrays([rest, values.filter(plain).filter(pc.invert(ok))])
                values = rest
            for value in values.to_pylist():
                if value is None:
                    bad.append("")
                    reasons.append("malformed: null")
                    continue
                if isinstance(value, bytes):  # a binary column (e.g. a Kafka value)
                    value = value.decode("ascii", "replace")
                if not value.isascii():
                    bad.append(value)
                    reasons.append("malformed: not ASCII")
                    continue
                for entry in value.split(","):
                    reason = add(entry)
                    if reason is not None:
                        bad.append(entry)
                        reasons.append(reason)
        folded = [(m.batch_id, m.group_id, bytes(m.bits), m.count) for m in folder.masks.values()]
        if heads:
            folded += _fold_single_ids(pa.concat_arrays(heads), np.concatenate(indexes))
        yield pa.RecordBatch.from_pydict({
            "batch_id": [f[0] for f in folded] + [None] * len(bad),
            "group_id": [f[1] for f in folded] + [None] * len(bad),
            "mask": [f[2] for f in folded] + [None] * len(bad),
            "folded": [f[3] for f in folded] + [None] * len(bad),
            "bad": [None] * len(folded) + bad,
            "reason": [None] * len(folded) + reasons,
        }, schema=pa.schema([("batch_id", pa.int64()), ("group_id", pa.int64()), ("mask", pa.binary()),
                             ("folded", pa.int64()), ("bad", pa.string()), ("reason", pa.string())]))
    return fold


def _apply_partition(dsn: str, schema: str) -> Callable[[Iterator[Any]], Iterator[dict]]:
    def apply(items: Iterator[Any]) -> Iterator[dict]:
        from .api import apply_masks

        masks: dict[tuple[int, int], GroupMask] = {}
        rejected: list[tuple[str, str]] = []
        for key, value in items:
            if key[0] < 0:
                rejected.append(value)
                continue
            bits, count = value
            masks[key] = GroupMask(key[0], key[1], bytearray(bits), _max_index(bits), count)
        result = {"acked": 0, "duplicates": 0, "completed": [], "rejected": rejected}
        if masks:
            with psycopg.connect(dsn, autocommit=True) as conn:  # apply_masks: one transaction
                r = apply_masks(conn, masks, schema=schema, reject_invalid=True)
            result.update(acked=r.acked, duplicates=r.duplicates, completed=r.completed,
                          rejected=rejected + r.rejected)
        yield result
    return apply


@dataclass
class AckTotals:
    acked: int = 0
    duplicates: int = 0
    completed: list[int] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (item id or run, reason)

    def add(self, other: "AckTotals | dict") -> None:
        get = other.get if isinstance(other, dict) else other.__getattribute__
        self.acked += get("acked")
        self.duplicates += get("duplicates")
        self.completed.extend(get("completed"))
        self.rejected.extend(tuple(r) for r in get("rejected"))


def ack_dataframe(df: Any, *, dsn: str, schema: str | None = None, column: str = "item_id",
                  partitions: int | None = None) -> AckTotals:
    """Ack the item ids (or runs, or ','-separated lists of them) in `column` of `df`.

    Bad entries (malformed, unknown batch/group, out of range, expired) are not applied and come
    back in `.rejected`; everything valid is applied. Idempotent: running it twice acks nothing new.
    """
    if column not in df.columns:
        raise ValueError(f"column {column!r} is not in the DataFrame (columns: {df.columns})")
    s = schema_of(schema)
    n = partitions or max(1, df.sparkSession.sparkContext.defaultParallelism)
    folded = df.select(column).mapInArrow(
        _fold_partition(column),
        "batch_id long, group_id long, mask binary, folded long, bad string, reason string")

    def keyed(partition: int, rows: Iterator[Any]) -> Iterator[tuple]:
        # Bad entries get keys of their own (negative, unique per partition and row), so one
        # reduceByKey pass carries them along untouched: the input is read once.
        seq = 0
        for r in rows:
            if r.batch_id is None:
                seq += 1
                yield (-1 - partition, seq), (r.bad, r.reason)
            else:
                yield (r.batch_id, r.group_id), (bytes(r.mask), r.folded)  # (Row.count is tuple.count)

    def combine(a: tuple, b: tuple) -> tuple:
        return _or_masks(a, b)

    results = (folded.rdd.mapPartitionsWithIndex(keyed)
               .reduceByKey(combine, numPartitions=n, partitionFunc=lambda k: k[0])
               .mapPartitions(_apply_partition(dsn, s)).collect())
    totals = AckTotals()
    for r in results:
        totals.add(r)
    return totals


# ---------------------------------------------------------------- streaming acks


@dataclass
class StreamTotals(AckTotals):
    batches: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def ack_stream(spark: Any, *, bootstrap_servers: str, topic: str, dsn: str, checkpoint_location: str,
               schema: str | None = None, dead_letter_topic: str | None = None, kafka_options: dict | None = None,
               dead_letter_client: dict | None = None,
               max_offsets_per_trigger: int | None = None, trigger_interval: str | None = None,
               partitions: int | None = None, min_partitions: int | None = None,
               query_name: str | None = None) -> tuple[Any, StreamTotals]:
    """Start a Structured Streaming query that acks every micro-batch of the ack topic.

    Needs the spark-sql-kafka-0-10 connector on the session's classpath (deploy/spark/jars.py).
    Offsets live in `checkpoint_location`; a micro-batch replayed after a failure re-applies its
    acks, which changes nothing. Rejected entries go to `dead_letter_topic` (reason header) before
    the micro-batch ends. `kafka_options`: options of Spark's Kafka consumer (without or with the
    `kafka.` prefix); `dead_letter_client`: librdkafka settings of the dead-letter producer.
    Returns the StreamingQuery and running totals (updated per micro-batch).
    """
    s = schema_of(schema)
    totals = StreamTotals()
    reader = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", bootstrap_servers)
              .option("subscribe", topic).option("startingOffsets", "earliest").option("failOnDataLoss", "false"))
    # ack messages are tiny: fetch more than the 1 MiB per partition default at a time
    options = {"max.partition.fetch.bytes": str(8 << 20),
               **{k.removeprefix("kafka."): v for k, v in (kafka_options or {}).items()}}
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
        result = ack_dataframe(batch_df, dsn=dsn, schema=s, column="ack", partitions=partitions)
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
    return writer.start(), totals


def _dead_letter(conf: dict, dead_letter_topic: str, source_topic: str, rejected: list[tuple[str, str]]) -> None:
    from confluent_kafka import Producer

    from . import metrics

    producer = Producer(conf)
    for entry, reason in rejected:
        key = entry.split(":", 1)[0].encode() if entry else None
        producer.produce(dead_letter_topic, key=key, value=entry.encode(),
                         headers=[("reason", reason.encode()), ("source-topic", source_topic.encode())])
    left = producer.flush(60)
    if left:
        raise RuntimeError(f"{left} dead letters were not delivered to {dead_letter_topic}")
    metrics.acks_dead_lettered.inc(len(rejected))
