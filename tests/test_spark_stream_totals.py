"""ack_stream's running totals stay bounded however long the query runs: counts of everything, and
only the last micro-batch's completed batch ids and rejected entries. The stream's foreachBatch
function is driven directly with micro-batches shaped as Spark's Kafka source gives them, on a
local Spark, without Kafka."""

from __future__ import annotations

import psycopg
import pytest

import tracker
from tracker import spark as tspark
from tracker.spark.stream import StreamTotals, _micro_batch

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]

RECORD = "ack binary, key binary, partition int, offset long, headers array<struct<key:string,value:binary>>"
MICRO_BATCHES, BAD_PER_BATCH = 6, 25


@pytest.fixture(scope="module")
def spark():
    session = tspark.local_session(
        "local[2,2]",
        app_name="tracker-stream-totals-tests",
        conf={"spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2"},
    )
    yield session
    session.stop()


def _closed_batch(pg_dsn, schema, n):
    with psycopg.connect(pg_dsn) as c:
        b = tracker.open_batch(c, tolerated_failures=n, schema=schema)
        tracker.add_items(c, b, n, schema=schema)
        tracker.close_batch(c, b, schema=schema)
        c.commit()
    return b.id


def test_running_totals_keep_counts_and_the_last_micro_batch_alone(spark, pg_dsn, schema):
    totals = StreamTotals()
    each = _micro_batch(
        totals,
        dsn=pg_dsn,
        schema=schema,
        topic="acks",
        label=f"totals-{schema}",
        partitions=None,
        dead_letter_topic=None,
        producer_conf={},
        after_apply=None,
    )
    offset, batches = 0, []
    for epoch in range(MICRO_BATCHES):
        b = _closed_batch(pg_dsn, schema, 2)
        batches.append(b)
        rows = [(f"{b}:0:0".encode(), str(b).encode(), 0, offset, [])]
        if epoch % 2:  # every other micro-batch holds a failure: the ordered path
            rows.append((f"!{b}:0:1".encode(), str(b).encode(), 0, offset + 1, [("failure-reason", b"timeout")]))
        else:
            rows.append((f"{b}:0:1".encode(), str(b).encode(), 0, offset + 1, []))
        rows += [(f"garbage-{epoch}-{k}".encode(), None, 1, offset + k, []) for k in range(BAD_PER_BATCH)]
        offset += 100
        each(spark.createDataFrame(rows, RECORD), epoch)
        with totals.lock:
            # the last micro-batch's lists, not everything seen so far
            assert totals.completed == [b]
            assert sorted(e for e, _ in totals.rejected) == sorted(f"garbage-{epoch}-{k}" for k in range(BAD_PER_BATCH))
    assert totals.batches == MICRO_BATCHES
    assert (totals.acked, totals.failed) == (MICRO_BATCHES + MICRO_BATCHES // 2, MICRO_BATCHES // 2)
    assert (totals.completed_count, totals.rejected_count) == (MICRO_BATCHES, MICRO_BATCHES * BAD_PER_BATCH)
    assert totals.progress.input_rows == MICRO_BATCHES * (2 + BAD_PER_BATCH)
    with psycopg.connect(pg_dsn) as c:
        assert [tracker.status(c, b, schema=schema).state for b in batches] == ["complete"] * MICRO_BATCHES
