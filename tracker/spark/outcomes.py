"""Outcomes from a DataFrame: item ids with an outcome column ('succeeded' or 'failed') and, for
failures, a reason column.

Failed rows take the path acks take (ack_dataframe), with the reason carried along: each partition
is sorted by reason and each run of one reason folded into masks per group (tracker.folding.
fold_arrow in mapInArrow); the masks of a (group, reason) are OR-ed across partitions
(a shuffle partitioned by batch id and sorted by batch, group and reason), and each resulting
partition records them as failures under their reason, reasons in sort order, in one transaction
per at most 4,096 groups. Then the succeeded rows are acked by ack_dataframe. Recording is idempotent (an item's first outcome wins:
a retried or speculative task changes nothing twice), and deterministic whatever the partitioning:
an item named as failed and as succeeded ends failed, one named under several reasons ends with
the first reason in sort order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg

from tracker.config import schema_of
from tracker.errors import InvalidValue
from tracker.folding import GROUPS_PER_FOLD_MAX, GroupMask, fold_arrow, or_bits
from tracker.spark.acks import ack_dataframe
from tracker.spark.columns import check_column
from tracker.spark.options import optional_tasks
from tracker.spark.worker import in_task

OUTCOMES = ("succeeded", "failed")
REASON_MAX = 500  # characters, as tracker.fail takes them


def _fail_partition(
    dsn: str,
    schema: str,
    after_apply: Callable[[int, int], None] | None = None,
    max_groups: int = GROUPS_PER_FOLD_MAX,
) -> Callable[[Iterator[Any]], Iterator[dict]]:
    def apply(items: Iterator[Any]) -> Iterator[dict]:
        from pyspark import TaskContext

        from tracker.core.acks import apply_op
        from tracker.drivers.sync_psycopg import run
        from tracker.sync import default

        t = default(schema)
        by_reason: dict[str, dict[tuple[int, int], GroupMask]] = {}
        rejected: list[tuple[str, str]] = []
        result: dict[str, Any] = {"failed": 0, "duplicates": 0, "completed": [], "rejected": rejected}
        conn: psycopg.Connection | None = None

        def record(reason: str, masks: dict[tuple[int, int], GroupMask]) -> None:
            nonlocal conn
            if conn is None:
                conn = psycopg.connect(dsn, autocommit=True, application_name="tracker.spark outcomes")
            # the masked path of tracker.fail: invalid entries left out and returned, the rest recorded
            op = apply_op(t._q_acks, masks, t.config.completion_topic, True, reason=reason)
            r = run(conn, op)
            result["failed"] += r.acked
            result["duplicates"] += r.duplicates
            result["completed"] += r.completed
            rejected.extend(r.rejected)

        try:
            # A partition holds every (group, reason) mask of its batches (partitioned by batch id),
            # sorted by (batch, group, reason): the masks of one key are OR-ed as they come, held at
            # most max_groups at once and recorded reason by reason in sort order. A group's reasons
            # come in sort order, so one split across rounds still meets its first reason first.
            held = 0
            for key, value in _merged(items):
                if key[0] < 0:
                    rejected.append(value)
                    continue
                batch_id, group_id, reason = key
                bits, count = value
                by_reason.setdefault(reason, {})[(batch_id, group_id)] = GroupMask.of_bits(
                    batch_id, group_id, bits, count
                )
                held += 1
                if held >= max_groups:
                    for r in sorted(by_reason):
                        record(r, by_reason[r])
                    by_reason, held = {}, 0
            for r in sorted(by_reason):
                record(r, by_reason[r])
        finally:
            if conn is not None:
                conn.close()
        if conn is not None and after_apply is not None:
            ctx = TaskContext.get()
            assert ctx is not None  # inside a Spark task
            after_apply(ctx.partitionId(), ctx.attemptNumber())
        yield result

    return apply


def _merged(items: Iterator[tuple[Any, Any]]) -> Iterator[tuple[Any, Any]]:
    """Sorted (key, (bits, count)) pairs with the masks of each key OR-ed into one (bad entries,
    keys of their own, pass as they are)."""
    key: Any = None
    value: Any = None
    for k, v in items:
        if key is not None and k == key and k[0] >= 0:
            value = or_bits(value, v)
            continue
        if key is not None:
            yield key, value
        key, value = k, v
    if key is not None:
        yield key, value


def _fold_by_reason(column: str, reason_column: str) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The fold of a partition sorted by reason: each run of one reason folded on its own (the
    fold's bounded memory), its rows tagged with the reason."""
    fold = fold_arrow(column)

    def fold_partition(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        def runs() -> Iterator[tuple[str, Any]]:
            for b in batches:
                reasons = b.column(reason_column).to_pylist()
                start = 0
                for i in range(1, len(reasons) + 1):
                    if i == len(reasons) or reasons[i] != reasons[start]:
                        yield reasons[start], b.slice(start, i - start)
                        start = i

        for reason, same in itertools.groupby(runs(), key=lambda r: r[0]):
            for out in fold(s for _, s in same):
                yield out.append_column("fail_reason", pa.array([reason] * out.num_rows, pa.string()))

    return fold_partition


@dataclass
class OutcomeTotals:
    succeeded: int = 0  # items this call acked
    failed: int = 0  # items this call failed
    duplicates: int = 0  # ids whose item already had its outcome (or named twice)
    completed: list[int] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (item id or run, reason)


def _check(df: Any, column: str, outcome_column: str, reason_column: str) -> None:
    """The first outcome or reason that cannot be recorded, as a typed error naming it (one pass
    over the input, before anything is recorded)."""
    from pyspark.sql import functions as f

    check_column(df, "column", column, ("string", "binary"))  # ids as text, or a Kafka value
    check_column(df, "outcome_column", outcome_column, ("string",))
    check_column(df, "reason_column", reason_column, ("string",))
    outcome, reason = f.col(outcome_column), f.col(reason_column)
    failed = outcome == f.lit("failed")
    bad = df.select(
        outcome.alias("outcome"),
        reason.alias("reason"),
        f.when(outcome.isNull() | ~outcome.isin(*OUTCOMES), f.lit(1))
        .when(failed & (reason.isNull() | (f.length(reason) == 0)), f.lit(2))
        .when(failed & (f.length(reason) > REASON_MAX), f.lit(3))
        .when(failed & f.instr(reason, "\x00").cast("boolean"), f.lit(4))
        .alias("why"),
    ).where(f.col("why").isNotNull())
    first = bad.limit(1).collect()
    if not first:
        return
    row = first[0]
    if row.why == 1:
        raise InvalidValue(outcome_column, row.outcome, "must be 'succeeded' or 'failed'")
    why = {
        2: "a failed item needs a reason (a non-empty string)",
        3: f"is longer than {REASON_MAX} characters ({len(row.reason or '')})",
        4: "contains a NUL character, which Postgres text cannot hold",
    }[row.why]
    raise InvalidValue(reason_column, row.reason, why)


def outcome_dataframe(
    df: Any,
    *,
    dsn: str,
    schema: str | None = None,
    column: str = "item_id",
    outcome_column: str = "outcome",
    reason_column: str = "reason",
    partitions: int | None = None,
    after_apply: Callable[[int, int], None] | None = None,
) -> OutcomeTotals:
    """Record the outcome of each item id (or run, or ','-separated list) in `column` of `df`:
    `outcome_column` 'succeeded' acks it, 'failed' records it as failed under `reason_column`
    (1 to 500 characters; ignored for succeeded rows).

    An outcome other than those two, or a failed row without a valid reason, raises InvalidValue
    naming the value before anything is recorded (the input is read once more for this check: a
    source that changes between reads is checked as it was then). Bad ids (malformed, unknown
    batch/group, out of range, expired) are not recorded and come back in `.rejected`; the valid
    rest is. Idempotent: the first outcome recorded for an item wins, so running it again records
    nothing new. `partitions` and `after_apply(partition, attempt)` (called after each partition's
    last transaction of failures, then of acks) are as in ack_dataframe.

    The database is exact whatever the attempts do; the totals are those of the attempts Spark
    kept (a task retried after its commit reports its items as duplicates).
    """
    optional_tasks("partitions", partitions)  # before the input is read: a bad count runs no job
    _check(df, column, outcome_column, reason_column)
    from pyspark.sql import functions as f

    s = schema_of(schema)
    n = partitions or max(1, df.sparkSession.sparkContext.defaultParallelism)
    failed = (
        df.where(f.col(outcome_column) == f.lit("failed"))
        .select(f.col(column), f.col(reason_column).alias("__reason"))
        .sortWithinPartitions("__reason")
    )
    folded = failed.mapInArrow(
        in_task(_fold_by_reason(column, "__reason")),
        "batch_id long, group_id long, mask binary, folded long, bad string, reason string, fail_reason string",
    )

    def keyed(partition: int, rows: Iterator[Any]) -> Iterator[tuple]:
        seq = 0  # bad entries: keys of their own (negative, unique), carried along untouched
        for r in rows:
            if r.batch_id is None:
                seq += 1
                yield (-1 - partition, seq, ""), (r.bad, r.reason)
            else:
                yield (r.batch_id, r.group_id, r.fail_reason), (bytes(r.mask), r.folded)

    results = (
        folded.rdd.mapPartitionsWithIndex(in_task(keyed))
        # sorted by key within each batch's partition (spilling as Spark sorts): _fail_partition
        # then meets each group's reasons in sort order, whatever rounds it records them in
        .repartitionAndSortWithinPartitions(numPartitions=n, partitionFunc=lambda k: k[0])
        .mapPartitions(in_task(_fail_partition(dsn, s, after_apply)))
        .collect()
    )
    totals = OutcomeTotals()
    for r in results:
        totals.failed += r["failed"]
        totals.duplicates += r["duplicates"]
        totals.completed.extend(r["completed"])
        totals.rejected.extend(tuple(x) for x in r["rejected"])
    succeeded = df.where(f.col(outcome_column) == f.lit("succeeded")).select(column)
    acked = ack_dataframe(succeeded, dsn=dsn, schema=s, column=column, partitions=partitions, after_apply=after_apply)
    totals.succeeded = acked.acked
    totals.duplicates += acked.duplicates
    totals.completed.extend(acked.completed)
    totals.rejected.extend(acked.rejected)
    return totals
