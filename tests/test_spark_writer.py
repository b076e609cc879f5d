"""A fan-out partition's write, without a JVM: concurrent attempts of one partition (speculative
execution) write it exactly once; a closed batch refuses it whole; a partition index written with
another number of rows fails instead of being skipped as written."""

from __future__ import annotations

import threading

import psycopg
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tracker_support import invariant_violations

import tracker
from tracker import spark as tspark


def _rows(n: int) -> list:
    values = [b"v%d" % i for i in range(n)]
    return [pa.RecordBatch.from_pydict({"value": values[k : k + 5000]}) for k in range(0, n, 5000)]


def _writer(pg_dsn, schema, batch_id, run):
    return tspark._PartitionWriter(pg_dsn, schema, "outbox", batch_id, run, "work", "value", None, None, None)


def test_concurrent_attempts_of_one_partition_write_it_once(pg_dsn, schema):
    n = 20_000
    with psycopg.connect(pg_dsn) as c:
        batch = tracker.open_batch(c, schema=schema)
        c.commit()
        run = tspark.begin_run(c, batch.id, schema=schema)
    writer = _writer(pg_dsn, schema, batch.id, run)
    start = threading.Barrier(4)
    errors = []

    def attempt():
        try:
            start.wait()
            writer._write(_rows(n), n, 7)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=attempt) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    with psycopg.connect(pg_dsn) as c:
        groups = c.execute(f'SELECT id, size FROM "{schema}".batch_group ORDER BY id').fetchall()
        assert groups == [(tspark.spark_group_id(run, 7, k), s) for k, s in enumerate([8192, 8192, 3616])]
        assert c.execute(f'SELECT count(*), count(DISTINCT header_values[1]) FROM "{schema}".outbox').fetchone() == (
            n,
            n,
        )
        assert tracker.status(c, batch, schema=schema).total == n
        assert invariant_violations(c, schema) == []


def test_a_partition_for_a_closed_batch_changes_nothing(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as c:
        batch = tracker.open_batch(c, schema=schema)
        c.commit()
        run = tspark.begin_run(c, batch.id, schema=schema)
        tracker.close_batch(c, batch, schema=schema)
        c.commit()
    with pytest.raises(tracker.BatchNotOpen, match=f"batch {batch.id} is complete"):
        _writer(pg_dsn, schema, batch.id, run)._write(_rows(10), 10, 0)
    with psycopg.connect(pg_dsn) as c:
        assert c.execute(f'SELECT count(*) FROM "{schema}".outbox').fetchone() == (1,)  # the completion event only
        assert c.execute(f'SELECT count(*) FROM "{schema}".batch_group').fetchone() == (0,)


def test_group_ids_of_spark_runs_never_meet_counter_ids():
    assert tspark.spark_group_id(0, 0, 0) == 1 << 62
    lo, hi = tspark.run_group_range(3)
    assert lo <= tspark.spark_group_id(3, tspark.MAX_PARTITIONS - 1, tspark.MAX_CHUNKS - 1) < hi
    assert tspark.run_group_range(4)[0] == hi
    with pytest.raises(ValueError):
        tspark.spark_group_id(tspark.MAX_RUNS, 0, 0)


def _counts(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as c:
        return [c.execute(f'SELECT count(*) FROM "{schema}".{t}').fetchone()[0] for t in ("batch_group", "outbox")]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=st.integers(1, 9000), second=st.integers(1, 9000))
def test_a_partition_written_with_another_row_count_fails_and_writes_nothing(pg_dsn, schema, first, second):
    with psycopg.connect(pg_dsn) as c:
        batch = tracker.open_batch(c, schema=schema)
        c.commit()
        run = tspark.begin_run(c, batch.id, schema=schema)
    writer = _writer(pg_dsn, schema, batch.id, run)
    writer._write(_rows(first), first, 3)
    before = _counts(pg_dsn, schema)
    if first == second:  # the same rows again: written, nothing to do
        writer._write(_rows(second), second, 3)
    else:
        with pytest.raises(RuntimeError, match=f"holds {second} rows, but {first} were written under its index"):
            writer._write(_rows(second), second, 3)
    assert _counts(pg_dsn, schema) == before
    with psycopg.connect(pg_dsn) as c:
        assert tracker.status(c, batch, schema=schema).total == first
