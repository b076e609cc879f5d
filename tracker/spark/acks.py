"""Acks from a DataFrame of item ids: fold per partition, OR per group, apply per partition.

Each partition folds its ids into one mask per group (tracker.folding.fold_arrow in mapInArrow), the
masks of a group are OR-ed across partitions (reduceByKey, partitioned by batch id), and each
resulting partition applies its masks through `tracker.core.acks.apply_masks`, exactly as the acker
does: in one transaction per at most 4,096 groups. Both steps hold at most that many groups'
masks (1 KiB each) at once, whatever the ids name. Applying is idempotent, so a retried or
speculative task clears nothing twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg

from tracker.config import schema_of
from tracker.folding import GROUPS_PER_FOLD_MAX, GroupMask, fold_arrow, or_bits
from tracker.spark.columns import check_column
from tracker.spark.options import optional_tasks
from tracker.spark.worker import in_task


def _apply_partition(
    dsn: str,
    schema: str,
    after_apply: Callable[[int, int], None] | None = None,
    max_groups: int = GROUPS_PER_FOLD_MAX,
) -> Callable[[Iterator[Any]], Iterator[dict]]:
    def apply(items: Iterator[Any]) -> Iterator[dict]:
        from pyspark import TaskContext

        from tracker.sync import apply_masks

        masks: dict[tuple[int, int], GroupMask] = {}
        rejected: list[tuple[str, str]] = []
        result: dict[str, Any] = {"acked": 0, "duplicates": 0, "completed": [], "rejected": rejected}
        conn: psycopg.Connection | None = None

        def apply_held() -> None:
            # One transaction per at most max_groups masks, so a partition's memory stays bounded
            # however many groups it was given (applying is idempotent: a retried task is harmless).
            nonlocal conn, masks
            if conn is None:
                conn = psycopg.connect(dsn, autocommit=True, application_name="tracker.spark ack")
            r = apply_masks(conn, masks, schema=schema, reject_invalid=True)
            masks = {}
            result["acked"] += r.acked
            result["duplicates"] += r.duplicates
            result["completed"] += r.completed
            rejected.extend(r.rejected)

        try:
            for key, value in items:
                if key[0] < 0:
                    rejected.append(value)
                    continue
                bits, count = value
                masks[key] = GroupMask.of_bits(key[0], key[1], bits, count)
                if len(masks) >= max_groups:
                    apply_held()
            if masks:
                apply_held()
        finally:
            if conn is not None:
                conn.close()
        if conn is not None and after_apply is not None:
            ctx = TaskContext.get()
            assert ctx is not None  # inside a Spark task
            after_apply(ctx.partitionId(), ctx.attemptNumber())
        yield result

    return apply


@dataclass
class AckTotals:
    acked: int = 0
    duplicates: int = 0
    completed: list[int] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (item id or run, reason)

    def add(self, other: AckTotals | dict[str, Any]) -> None:
        values = other if isinstance(other, dict) else vars(other)
        self.acked += values["acked"]
        self.duplicates += values["duplicates"]
        self.completed.extend(values["completed"])
        self.rejected.extend(tuple(r) for r in values["rejected"])


def ack_dataframe(
    df: Any,
    *,
    dsn: str,
    schema: str | None = None,
    column: str = "item_id",
    partitions: int | None = None,
    after_apply: Callable[[int, int], None] | None = None,
) -> AckTotals:
    """Ack the item ids (or runs, or ','-separated lists of them) in `column` of `df`.

    Bad entries (malformed, unknown batch/group, out of range, expired) are not applied and come
    back in `.rejected`; everything valid is applied. Idempotent: running it twice acks nothing new.
    `partitions`: tasks that apply masks (1 to 100,000; default: the default parallelism), each in
    one transaction per at most 4,096 groups. `after_apply(partition, attempt)` runs on the executor after a
    partition's last transaction (instrumentation, failure tests).

    The database is exact whatever the attempts do; the totals are those of the attempts Spark
    kept: when a task is retried after its transaction committed (lost executor, speculation),
    its acks come back as duplicates and a completion it made is missing from `.completed`
    (the completion event itself is in the outbox, written once).
    """
    check_column(df, "column", column, ("string", "binary"))  # ids as text, or a Kafka value
    optional_tasks("partitions", partitions)
    s = schema_of(schema)
    n = partitions or max(1, df.sparkSession.sparkContext.defaultParallelism)
    folded = df.select(column).mapInArrow(
        in_task(fold_arrow(column)), "batch_id long, group_id long, mask binary, folded long, bad string, reason string"
    )

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

    results = (
        folded.rdd.mapPartitionsWithIndex(in_task(keyed))
        .reduceByKey(or_bits, numPartitions=n, partitionFunc=lambda k: k[0])
        .mapPartitions(in_task(_apply_partition(dsn, s, after_apply)))
        .collect()
    )
    totals = AckTotals()
    for r in results:
        totals.add(r)
    return totals
