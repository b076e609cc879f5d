"""Fan a DataFrame out into the outbox: one message per row, tracked in a batch.

The driver takes a run number of the batch (tracker.spark.runs); each partition then writes,
in ONE Postgres transaction, its groups (ids derived from run, Spark partition id and chunk, in a
range the counter-allocated groups never reach), its messages (binary COPY) and the batch totals.
The group insert is `ON CONFLICT DO NOTHING`: an attempt that finds its partition's groups already
there (a retried attempt after a lost executor, or a speculative copy, of a partition some attempt
already committed) writes nothing, so the outbox never holds a partition twice. An attempt killed
before its commit leaves nothing (Postgres aborts its transaction). After the job the driver
closes the batch. Rows stream through the executors: the driver holds none of them.

Executors connect to Postgres themselves (`dsn`), so the DSN must be reachable from them.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from tracker.config import DEFAULT_OUTBOX_TABLE, schema_of
from tracker.core.validate import check_topic, check_user_key
from tracker.errors import BatchNotOpen, InvalidArgument, InvalidValue
from tracker.ids import GROUP_BITS_MAX
from tracker.spark.columns import check_column
from tracker.spark.runs import PartitionsChanged, begin_run, check_run_key, job_batch
from tracker.spark.worker import in_task

# Group ids of Spark fan-out: flag | run << 40 | partition << 20 | chunk. Counter-allocated
# groups (batch.next_group) count up from 0 and never get near 2**62.
SPARK_GROUP_FLAG = 1 << 62
_RUN_SHIFT, _PARTITION_SHIFT = 40, 20
MAX_RUNS, MAX_PARTITIONS, MAX_CHUNKS = 1 << 22, 1 << 20, 1 << 20


def spark_group_id(run: int, partition: int, chunk: int) -> int:
    if not (0 <= run < MAX_RUNS and 0 <= partition < MAX_PARTITIONS and 0 <= chunk < MAX_CHUNKS):
        raise ValueError(f"run {run}, partition {partition}, chunk {chunk} out of range for a Spark group id")
    return SPARK_GROUP_FLAG | run << _RUN_SHIFT | partition << _PARTITION_SHIFT | chunk


def run_group_range(run: int) -> tuple[int, int]:
    """[lo, hi) of the group ids of one fan-out run."""
    lo = spark_group_id(run, 0, 0)
    return lo, lo + (1 << _RUN_SHIFT)


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
    before_commit: Callable[[int, int], None] | None = None

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import TaskContext

        ctx = TaskContext.get()
        assert ctx is not None  # inside a Spark task
        partition, attempt = ctx.partitionId(), ctx.attemptNumber()
        held = [b for b in batches if b.num_rows]  # Arrow buffers: the partition's rows, compactly
        n = sum(b.num_rows for b in held)
        if n:
            self._write(held, n, partition, attempt)
            if self.after_commit is not None:
                self.after_commit(partition, attempt)
        if self.id_col is None:
            yield pa.RecordBatch.from_pydict(
                {"partition": [partition], "items": [n]},
                schema=pa.schema([("partition", pa.int32()), ("items", pa.int64())]),
            )
            return
        pos = 0
        for b in held:
            ids = [self._item_id(partition, pos + j) for j in range(b.num_rows)]
            pos += b.num_rows
            yield pa.RecordBatch.from_arrays(
                [*b.columns, pa.array(ids, pa.string())], names=[*b.schema.names, self.id_col]
            )

    def _item_id(self, partition: int, position: int) -> str:
        chunk, index = divmod(position, GROUP_BITS_MAX)
        return f"{self.batch_id}:{spark_group_id(self.run, partition, chunk)}:{index}"

    def _write(self, held: list[Any], n: int, partition: int, attempt: int = 0) -> None:
        sizes = [GROUP_BITS_MAX] * (n // GROUP_BITS_MAX) + ([n % GROUP_BITS_MAX] if n % GROUP_BITS_MAX else [])
        if len(sizes) > MAX_CHUNKS:
            raise ValueError(f"partition {partition} has {n} rows: at most {MAX_CHUNKS * GROUP_BITS_MAX} per partition")
        group_ids = [spark_group_id(self.run, partition, c) for c in range(len(sizes))]
        s = self.schema
        name = f"tracker.spark fan_out {self.batch_id}/{self.run}/{partition}"  # pg_stat_activity
        with psycopg.connect(self.dsn, application_name=name) as conn:  # one transaction: commits at block end
            inserted = conn.execute(
                sql.SQL(
                    "INSERT INTO {} (batch_id, id, size, pending, bits) "
                    "SELECT %s, g, sz, sz, repeat('1', sz)::varbit FROM unnest(%s::int8[], %s::int4[]) AS u(g, sz) "
                    "ON CONFLICT (batch_id, id) DO NOTHING RETURNING id"
                ).format(sql.Identifier(s, "batch_group")),
                [self.batch_id, group_ids, sizes],
            ).fetchall()
            if len(inserted) != len(sizes):
                # Some attempt committed this partition index: it is written only if it held these
                # rows, which its groups' total size tells (a layout changed between submissions, or
                # an input that is not deterministic, puts other rows under the same index).
                lo = spark_group_id(self.run, partition, 0)
                written = conn.execute(
                    sql.SQL(
                        "SELECT coalesce(sum(size), 0) FROM {} "
                        "WHERE batch_id = %s AND id >= %s AND id < %s AND id <> ALL(%s::int8[])"
                    ).format(sql.Identifier(s, "batch_group")),
                    [self.batch_id, lo, lo + MAX_CHUNKS, [r[0] for r in inserted]],  # not this attempt's
                ).fetchone()
                if inserted or written is None or written[0] != n:
                    raise RuntimeError(
                        f"partition {partition} of batch {self.batch_id} run {self.run} holds {n} rows, but "
                        f"{written[0] if written else 0} were written under its index: its rows changed between "
                        "attempts or submissions (a partition must hold the same rows in the same order on every "
                        "one); nothing of it was written again"
                    )
                return  # an earlier attempt committed this partition: write nothing
            self._copy_messages(conn, held, group_ids)
            grown = conn.execute(
                sql.SQL(
                    "UPDATE {} SET total = total + %s, pending = pending + %s, last_activity_at = clock_timestamp() "
                    "WHERE id = %s AND state = 'open' RETURNING id"
                ).format(sql.Identifier(s, "batch")),
                [n, n, self.batch_id],
            ).fetchone()
            if grown is None:
                state = conn.execute(
                    sql.SQL("SELECT state FROM {} WHERE id = %s").format(sql.Identifier(s, "batch")), [self.batch_id]
                ).fetchone()
                raise BatchNotOpen(self.batch_id, state[0] if state else "gone")
            if self.before_commit is not None:
                self.before_commit(partition, attempt)

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
                out.append(
                    header_keys
                    + _int4(20 + 4 + id_len + len(tail))
                    + _int4(1)
                    + _int4(0)
                    + _int4(17)
                    + _int4(2)
                    + _int4(1)
                    + _int4(id_len)
                    + prefix
                )
            return out

        def rows() -> Iterator[tuple[Any, Any]]:
            for b in held:
                values = b.column(self.value_col).to_pylist()
                keys = b.column(self.key_col).to_pylist() if self.key_col else [None] * len(values)
                yield from zip(values, keys)

        copy_sql = sql.SQL("COPY {} (topic, key, value, header_keys, header_values) FROM STDIN (FORMAT BINARY)").format(
            sql.Identifier(self.schema, self.outbox_table)
        )
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
    items: int  # rows written by this run (from the database, whatever the attempts did)
    groups: int
    complete: bool  # the batch was closed and is complete (e.g. nothing was written)
    dataframe: Any = None  # with id_col: the input rows plus their item ids, checkpointed on the executors


def fan_out(
    df: Any,
    *,
    dsn: str,
    topic: str,
    schema: str | None = None,
    batch: Any = None,
    user_key: str | None = None,
    completion_topic: str | None = None,
    value_col: str = "value",
    key_col: str | None = None,
    id_col: str | None = None,
    run_key: str | None = None,
    close: bool = True,
    after_commit: Callable[[int, int], None] | None = None,
    before_commit: Callable[[int, int], None] | None = None,
) -> FanOutResult:
    """Write one outbox message per row of `df` on `topic` and track the rows in a batch.

    `batch`: a tracker Batch or batch id (open); None opens a new batch (`user_key`,
    `completion_topic`). `value_col`/`key_col`: binary or string columns. With `id_col`, the
    result's `.dataframe` is `df` plus that column of item ids (locally checkpointed, so the job
    runs once; the checkpoint lives on the executors, and reading it fails once one of them is
    lost: write it out first when it must outlive them). `close`: close the batch after the job. `after_commit(partition, attempt)` runs on
    the executor after a partition's transaction, `before_commit` inside it after its writes
    (instrumentation, failure tests).

    `run_key` (up to 1,000 characters) names the job, so that the same call made again (a job
    submitted again after a failure, or by a scheduler that retries) writes only the partitions
    the earlier one did not commit: without `batch`, it finds the batch a job of that key opened
    (one key, one batch: a different `user_key` or `completion_topic` raises InvalidValue), or
    opens it; with `batch`, it finds the run of that key in the batch. A job that had finished
    finds every partition written and writes nothing. Without `run_key`, each call is a new run:
    calling again after a failure writes every row again.

    When the call fails after the batch is known (opened, found or given), the exception carries
    `.batch_id` and `.run` (None before a run was taken) and a note naming them: a batch this call
    opened stays open with the partitions written until it is closed or expires.

    As for any Spark job that writes, a partition must hold the same rows in the same order on
    every attempt (sort or checkpoint a non-deterministic input first): an attempt that finds its
    partition written skips it whole, and one whose row count changed fails instead of writing.
    The run records `df`'s partition count: the same run key with another count raises
    PartitionsChanged (an InvalidValue named `partitions`) before anything is written.
    """
    from pyspark.sql.types import StringType, StructField, StructType

    from tracker.core.batches import batch_id_of
    from tracker.sync import close_batch, open_batch

    # Everything checked before the batch is opened or a run begun: nothing is written for bad input.
    check_topic(topic, "topic")
    check_column(df, "value_col", value_col, ("binary", "string"))
    if key_col is not None:
        check_column(df, "key_col", key_col, ("binary", "string"))
    if id_col is not None:
        if not isinstance(id_col, str) or not id_col:
            raise InvalidArgument("id_col", id_col, "a column name (a non-empty str) or None")
        if id_col in df.columns:
            raise InvalidValue("id_col", id_col, "is already a column of the DataFrame: name a new one")
    run_key = check_run_key(run_key)
    if batch is None:
        check_user_key(user_key)
        if completion_topic is not None:
            check_topic(completion_topic, "completion_topic")
        batch_id: int | None = None
    else:
        batch_id = batch_id_of(batch)
    partitions = df.rdd.getNumPartitions()
    if partitions > MAX_PARTITIONS:
        raise InvalidValue("df", f"{partitions} partitions", f"at most {MAX_PARTITIONS} partitions per fan-out")
    s = schema_of(schema)
    run: int | None = None
    try:
        with psycopg.connect(dsn) as conn:
            if batch_id is None and run_key is not None:
                batch_id = job_batch(
                    conn, run_key, schema=s, user_key=user_key, completion_topic=completion_topic, partitions=partitions
                )
            elif batch_id is None:
                batch_id = open_batch(conn, user_key=user_key, completion_topic=completion_topic, schema=s).id
                conn.commit()
            run = begin_run(conn, batch_id, schema=s, run_key=run_key, partitions=partitions)
        writer = _PartitionWriter(
            dsn, s, DEFAULT_OUTBOX_TABLE, batch_id, run, topic, value_col, key_col, id_col, after_commit, before_commit
        )
        out_df = None
        if id_col is None:
            df.mapInArrow(in_task(writer), "partition int, items long").collect()
        else:
            out_schema = StructType([*df.schema.fields, StructField(id_col, StringType(), True)])
            out_df = df.mapInArrow(in_task(writer), out_schema).localCheckpoint(eager=True)
        lo, hi = run_group_range(run)
        with psycopg.connect(dsn) as conn:
            counted = conn.execute(
                sql.SQL(
                    "SELECT count(*), coalesce(sum(size), 0) FROM {} WHERE batch_id = %s AND id >= %s AND id < %s"
                ).format(sql.Identifier(s, "batch_group")),
                [batch_id, lo, hi],
            ).fetchone()
            assert counted is not None  # an aggregate: always one row
            groups, items = counted
            complete = close_batch(conn, batch_id, schema=s) if close else False
            conn.commit()
    except Exception as exc:
        if batch_id is not None:
            _name_the_batch(exc, batch_id, run, run_key)
        raise
    return FanOutResult(batch_id, run, int(items), int(groups), complete, out_df)


def _name_the_batch(exc: Exception, batch_id: int, run: int | None, run_key: str | None) -> None:
    """Tell the caller of a failed fan-out which batch (and run) it was writing."""
    if isinstance(exc, PartitionsChanged):
        run = exc.run  # the run the key names, which this call refused to take
    with contextlib.suppress(AttributeError, TypeError):  # an exception type without a __dict__
        exc.batch_id = batch_id  # type: ignore[attr-defined]
        exc.run = run  # type: ignore[attr-defined]
    again = ""
    if run_key and not isinstance(exc, PartitionsChanged):
        again = f"; the same call with run_key={run_key!r} writes only what is missing"
    exc.add_note(f"fan_out: batch {batch_id}, run {run}{again}")
