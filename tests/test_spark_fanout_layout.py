"""A fan-out run records its layout: the partition count of its job (spark_fanout_run.partitions)
and each partition's row count (the size of its groups). A job submitted again with the same run
key and another partition count is refused before it writes; a partition index already written
with another number of rows fails instead of being skipped as written. Either way no row is lost
and none is published twice."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tracker_support import invariant_violations

import tracker
from tracker import spark as tspark
from tracker.errors import InvalidValue

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]


@pytest.fixture(scope="module")
def spark():
    session = tspark.local_session(
        "local[2,2]", app_name="tracker-fanout-layout-tests", conf={"spark.sql.shuffle.partitions": "2"}
    )
    yield session
    session.stop()


def _hashed(spark, n: int, partitions: int):
    """The rows as deploy/spark/fan_out_job.py splits them for --partitions."""
    df = spark.range(0, n, numPartitions=3).selectExpr("CAST(concat('row-', id) AS BINARY) AS value")
    return df.repartition(partitions, "value").sortWithinPartitions("value")


def _state(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as c:
        return [
            c.execute(f'SELECT count(*) FROM "{schema}".{table}').fetchone()[0]
            for table in ("batch", "batch_group", "outbox", "spark_fanout_run")
        ]


def _outbox(pg_dsn, schema, batch_id):
    with psycopg.connect(pg_dsn) as c:
        return c.execute(
            f'SELECT count(*), count(DISTINCT value) FROM "{schema}".outbox WHERE topic = %s AND header_values[2] = %s',
            ["work", str(batch_id)],
        ).fetchone()


def _failing(partition_to_fail: int):
    def fail(partition, attempt):  # on every attempt, before the commit (pickled by value)
        if partition == partition_to_fail:
            raise RuntimeError(f"injected: partition {partition} ran out of memory")

    return fail


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=st.integers(2, 5), second=st.integers(2, 7), given_batch=st.booleans())
def test_a_job_submitted_again_with_another_partition_count_is_refused_before_it_writes(
    spark, pg_dsn, schema, first, second, given_batch
):
    n, key = 600, f"layout-{uuid.uuid4().hex}"  # examples share the schema
    kw = {"dsn": pg_dsn, "topic": "work", "schema": schema, "run_key": key}
    if given_batch:  # a run key of a run in the caller's batch, or of a job that opens its own
        with psycopg.connect(pg_dsn) as c:
            kw["batch"] = tracker.open_batch(c, schema=schema)
            c.commit()
    with pytest.raises(Exception, match="ran out of memory") as failed:
        tspark.fan_out(_hashed(spark, n, first), **kw, before_commit=_failing(first - 1))
    if second != first:
        before = _state(pg_dsn, schema)
        with pytest.raises(InvalidValue) as refused:  # tspark.PartitionsChanged
            tspark.fan_out(_hashed(spark, n, second), **kw)
        assert isinstance(refused.value, tspark.PartitionsChanged)
        assert (refused.value.name, refused.value.value, refused.value.recorded) == ("partitions", second, first)
        assert (refused.value.batch_id, refused.value.run) == (failed.value.batch_id, failed.value.run)
        assert f"taken with {first} partitions" in str(refused.value)
        assert _state(pg_dsn, schema) == before
    done = tspark.fan_out(_hashed(spark, n, first), **kw)
    assert (done.batch_id, done.run, done.items) == (failed.value.batch_id, failed.value.run, n)
    assert _outbox(pg_dsn, schema, done.batch_id) == (n, n)
    with psycopg.connect(pg_dsn) as c:
        assert invariant_violations(c, schema) == []
