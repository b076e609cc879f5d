"""The counts tracker.spark's functions take (partitions, min_partitions, max_offsets_per_trigger)
are checked on the driver: a count Spark cannot use is refused with a typed error naming it before
any job runs (a negative one used to make no apply task at all: every ack was dropped, unreported)."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import tracker
from tracker import spark as tspark
from tracker.errors import InvalidArgument, InvalidValue
from tracker.spark.options import OFFSETS_MAX, TASKS_MAX

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]

BAD_TASKS = st.one_of(
    st.integers(max_value=0),
    st.integers(min_value=TASKS_MAX + 1),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.just([2]),
)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def spark():
    session = tspark.local_session(
        "local[2,2]",
        app_name="tracker-argument-tests",
        conf={"spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2"},
    )
    yield session
    session.stop()


def _closed_batch(pg_dsn, schema, n=3):
    with psycopg.connect(pg_dsn) as c:
        b = tracker.open_batch(c, schema=schema)
        tracker.add_items(c, b, n, schema=schema)
        tracker.close_batch(c, b, schema=schema)
        c.commit()
    return b


def _refused_before_any_job(spark, call, name, value):
    """`call()` raises the typed error naming `name` as written, and Spark ran no job for it."""
    sc = spark.sparkContext
    group = f"refused-{uuid.uuid4().hex}"
    sc.setJobGroup(group, "a call that must be refused")
    try:
        with pytest.raises((InvalidArgument, InvalidValue)) as raised:
            call()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    assert raised.value.name == name and raised.value.value is value
    assert list(sc.statusTracker().getJobIdsForGroup(group)) == []


def _pending(pg_dsn, schema, b):
    with psycopg.connect(pg_dsn) as c:
        st_ = tracker.status(c, b, schema=schema)
        return st_.state, st_.pending


@SETTINGS
@given(bad=BAD_TASKS)
def test_ack_dataframe_refuses_a_partitions_count_spark_cannot_use(spark, pg_dsn, schema, bad):
    b = _closed_batch(pg_dsn, schema)
    df = spark.createDataFrame([(f"{b.id}:0:0-2",), ("garbage",)], "item_id string")
    _refused_before_any_job(
        spark, lambda: tspark.ack_dataframe(df, dsn=pg_dsn, schema=schema, partitions=bad), "partitions", bad
    )
    assert _pending(pg_dsn, schema, b) == ("closed", 3)


@SETTINGS
@given(bad=BAD_TASKS)
def test_outcome_dataframe_refuses_a_partitions_count_before_recording_failures(spark, pg_dsn, schema, bad):
    b = _closed_batch(pg_dsn, schema)
    df = spark.createDataFrame(
        [(f"{b.id}:0:0", "failed", "no price"), (f"{b.id}:0:1-2", "succeeded", None)],
        "item_id string, outcome string, reason string",
    )
    _refused_before_any_job(
        spark, lambda: tspark.outcome_dataframe(df, dsn=pg_dsn, schema=schema, partitions=bad), "partitions", bad
    )
    assert _pending(pg_dsn, schema, b) == ("closed", 3)


@SETTINGS
@given(
    name=st.sampled_from(["partitions", "min_partitions", "max_offsets_per_trigger"]),
    bad=st.one_of(BAD_TASKS, st.integers(min_value=OFFSETS_MAX + 1)),
)
def test_ack_stream_refuses_a_count_before_the_query_starts(spark, pg_dsn, schema, tmp_path_factory, name, bad):
    valid_bound = isinstance(bad, int) and not isinstance(bad, bool) and 1 <= bad <= OFFSETS_MAX
    assume(not (name == "max_offsets_per_trigger" and valid_bound))  # a large bound of messages is valid
    kw = {
        "bootstrap_servers": "127.0.0.1:1",  # never reached
        "topic": "acks",
        "dsn": pg_dsn,
        "schema": schema,
        "checkpoint_location": str(tmp_path_factory.mktemp("cp")),
        name: bad,
    }
    _refused_before_any_job(spark, lambda: tspark.ack_stream(spark, **kw), name, bad)
    assert spark.streams.active == []


@pytest.mark.parametrize("partitions", [None, 1, 3])
def test_a_valid_partitions_count_applies_every_ack(spark, pg_dsn, schema, partitions):
    b = _closed_batch(pg_dsn, schema)
    df = spark.createDataFrame([(f"{b.id}:0:0-1",), (f"{b.id}:0:2",), ("garbage",)], "item_id string")
    totals = tspark.ack_dataframe(df, dsn=pg_dsn, schema=schema, partitions=partitions)
    assert (totals.acked, totals.completed, [e for e, _ in totals.rejected]) == (3, [b.id], ["garbage"])
    assert _pending(pg_dsn, schema, b) == ("complete", 0)
